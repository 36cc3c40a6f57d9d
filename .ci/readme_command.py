"""Print one of the README's set-up commands, exactly as written: `main` (the first bash block of the set-up section)
or `tests` (the second). CI runs what the README says, so the two cannot drift apart."""

import re
import sys
from pathlib import Path

readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
blocks = re.findall(r"```bash\n(.*?)```", setup, flags=re.S)
if len(blocks) != 2:
    sys.exit(f"README's set-up section has {len(blocks)} bash blocks, expected 2 (the main command, the tests)")
print(blocks[{"main": 0, "tests": 1}[sys.argv[1]]].strip())
