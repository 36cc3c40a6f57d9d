"""No first-party module grows past `MAX_LINES`: a module is one concept a reader can name (docs/architecture.md),
and a file past this size has become two. Split it by concept, not by line count."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("amphista_jax", "train", "evals", "pallas_kernels")
MAX_LINES = 450


def oversized(folders: list[Path], max_lines: int = MAX_LINES) -> dict[str, int]:
    """Every `.py` file under `folders` with more than `max_lines` lines: its path -> its line count."""
    found = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > max_lines:
                found[str(path.relative_to(folder.parent))] = lines
    return found


def test_no_module_is_over_the_size_limit():
    assert (ROOT / "evals" / "runner.py").is_file()  # the folders are the ones that hold the modules
    found = oversized([ROOT / f for f in FOLDERS])
    assert not found, f"modules over {MAX_LINES} lines (split each by concept): " + ", ".join(
        f"{p} ({n})" for p, n in sorted(found.items()))


def test_the_check_finds_a_long_module(tmp_path):
    package = tmp_path / "pkg" / "sub"
    package.mkdir(parents=True)
    (package / "short.py").write_text("x = 1\n" * MAX_LINES)
    (package / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert oversized([tmp_path / "pkg"]) == {"pkg/sub/long.py": MAX_LINES + 1}
