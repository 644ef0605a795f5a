"""jaxspec's packages are layered: no two of them import each other, directly or in a circle.

The package graph is computed from the source (every import statement, lazy ones inside
functions included) by tools/update_build.py, the same graph BUILD's targets follow: one node per
package of jaxspec/ and pallas_kernels/, per module at the root of jaxspec/, and per package the
launch scripts share (launch/cli/, launch/benchmarks/). The layers it must respect are those of
docs/architecture.md, "The layout: packages in layers": errors and config at the bottom, then
state, sharding, quant and sampling, models, io, drafters, speculative, the applications (serve,
train, plan, profiling), and the scripts' own packages on top, outside the pip package (the
library never imports them); a kernel folder never imports the model that calls it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _generator():
  spec = importlib.util.spec_from_file_location(
    "update_build", os.path.join(ROOT, "tools", "update_build.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _copy_sources(dst) -> None:
  """The library's .py files (no assets) under `dst`, as the tree has them."""
  for top in ("jaxspec", "pallas_kernels"):
    shutil.copytree(
      os.path.join(ROOT, top),
      dst / top,
      ignore=lambda d, names: [n for n in names if n in ("assets", "__pycache__")],
    )


def test_no_import_cycle_between_packages():
  cycles = _generator().import_cycles(ROOT)
  assert not cycles, f"packages importing each other in a circle: {cycles}"


def test_graph_sees_every_package():
  graph = _generator().package_graph(ROOT)
  for target in ("jaxspec", "jaxspec_state", "jaxspec_models", "jaxspec_speculative"):
    assert target in graph
  assert "jaxspec_state" in graph["jaxspec_models"]  # models read and write the state
  assert "jaxspec_drafters" in graph["jaxspec_speculative"]  # the engine runs the protocol


def test_the_library_never_imports_the_scripts_packages():
  """jaxspec/ and pallas_kernels/ are the pip package: launch/cli and launch/benchmarks sit on
  top of them, never below."""
  graph = _generator().package_graph(ROOT)
  scripts = {t for t in graph if t.startswith("launch_")}
  assert {"launch_cli", "launch_benchmarks"} <= scripts
  assert "launch_cli" in graph["launch_benchmarks"]
  for target, deps in graph.items():
    if target not in scripts:
      assert not deps & scripts, f"{target} imports {sorted(deps & scripts)}"


def test_one_import_closing_a_cycle_fails(tmp_path):
  """Mutation: one lazy import of a higher package from a lower one is a cycle."""
  gen = _generator()
  _copy_sources(tmp_path)
  assert not gen.import_cycles(str(tmp_path))
  state = tmp_path / "jaxspec" / "state" / "__init__.py"
  state.write_text(
    state.read_text() + "\n\ndef _late():\n  from jaxspec.speculative import engine  # noqa\n"
  )
  cycles = gen.import_cycles(str(tmp_path))
  assert any({"jaxspec_state", "jaxspec_speculative"} <= set(c) for c in cycles), cycles


def test_kernel_references_stand_alone(tmp_path):
  """Mutation: a kernel folder importing the model that dispatches to it is a cycle."""
  gen = _generator()
  _copy_sources(tmp_path)
  ref = tmp_path / "pallas_kernels" / "gated_delta" / "reference.py"
  ref.write_text(ref.read_text() + "\nfrom jaxspec.models import gated_deltanet  # noqa\n")
  cycles = gen.import_cycles(str(tmp_path))
  assert any("pallas_kernels_gated_delta" in c for c in cycles), cycles
