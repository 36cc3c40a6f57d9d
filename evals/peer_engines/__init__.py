"""The reference packages' own generation loops (`tests/reference-packages.txt`), run on our target beside our
engine by `evals/benchmarks/peers.py`: medusa-llm's `medusa_generate`, eagle-llm's `eagenerate`, dflash's
`dflash_generate`. Each module wraps one loop as a side of that benchmark (`side(ids, max_new_tokens)` -> the new
token ids, the wall-clock seconds of the call, tau and the tokens committed by each verify step, read from the
loop's own acceptance variable) and names every fix the package needs to run here, in its docstring and as a
function of its own. torch and the packages are imported only here (`pip install -e ".[peers]"` and the packages'
install line).
"""
