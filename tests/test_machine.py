"""Results name the machine they ran on: the CPU model and the vector extensions XLA:CPU's speed depends on (or the
accelerator), cores, memory and versions; another feature set is another machine."""

from __future__ import annotations

import dataclasses
import json

from amphista_jax.evals.benchmarks.common import write_report
from amphista_jax.infra.machine import cpu_model_and_isa, this_machine

EPYC_AVX2 = """processor\t: 0
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse2 avx fma avx2 bmi2
processor\t: 1
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse2 avx fma avx2 bmi2
"""
XEON_AMX = "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd sve\nCPU part\t: 0xd40\n"


def test_cpu_model_and_vector_extensions_are_read_from_cpuinfo():
    assert cpu_model_and_isa(EPYC_AVX2) == ("AMD EPYC 7B12", ("avx2", "fma"))
    assert cpu_model_and_isa(XEON_AMX) == ("Intel(R) Xeon(R) Platinum 8480+",
                                           ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"))
    assert cpu_model_and_isa(ARM) == ("0xd40", ("asimd", "sve"))


def test_another_feature_set_or_version_is_another_machine():
    here = this_machine()
    assert here.backend == "cpu" and here.cores >= 1 and here.memory_gib > 0
    assert here.describe().startswith(f"cpu: {here.device}") and f"jax {here.jax}" in here.describe()
    assert dataclasses.replace(here, isa=("avx2",)).key() != here.key()
    assert dataclasses.replace(here, library="0.0.0").key() != here.key()
    assert dataclasses.replace(here).key() == here.key()


def test_every_benchmark_report_names_its_machine(tmp_path, capsys):
    write_report(tmp_path, "bench", {"rows": [1]}, "| a |\n|---|")
    md = (tmp_path / "bench.md").read_text()
    assert md.startswith(f"Machine: {this_machine().describe()}\n") and "| a |" in md
    machine = json.loads((tmp_path / "bench.json").read_text())["machine"]
    assert machine == json.loads(json.dumps(dataclasses.asdict(this_machine())))
    assert capsys.readouterr().out.startswith("Machine: ")
