"""The peers benchmark's export matrix (`evals/benchmarks/peers.export_matrix`): each shipped head set in each
reference layout, written or the one-line reason it is not, on the embedded model's shipped heads."""

from __future__ import annotations

from amphista_jax import Generator
from amphista_jax.drafters.exported import LAYOUTS
from amphista_jax.evals.benchmarks.peers import export_matrix


def test_the_export_matrix_says_what_each_layout_holds():
    matrix = export_matrix(Generator.load(), ["medusa", "eagle", "hydra"])
    assert set(matrix) == {"medusa", "eagle", "hydra"} and all(set(row) == set(LAYOUTS) for row in matrix.values())
    assert matrix["medusa"]["medusa"] == "written"  # one ResBlock, its own lm_head, the whole vocabulary
    assert "input_norm=True" in matrix["eagle"]["eagle"]  # trained here with an input norm: not EAGLE's layer 0
    assert matrix["hydra"]["medusa"].startswith("are not Medusa heads")
    assert all(cell == "written" or not cell.startswith("these") for row in matrix.values() for cell in row.values())
