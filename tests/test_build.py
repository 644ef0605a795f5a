"""BUILD stays in step with the source tree.

The BUILD file is evaluated as Starlark (which is Python syntax) with stub
rule functions that record each target, then checked against the files on
disk: every library module and every test module must belong to a target,
every local dependency label must exist, and the file must equal what
tools/update_build.py generates now. When this fails after adding a module,
run ``python tools/update_build.py``.
"""

from __future__ import annotations

import glob
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = "run `python tools/update_build.py` and commit the new BUILD"


def _load_generator():
  spec = importlib.util.spec_from_file_location(
    "update_build", os.path.join(ROOT, "tools", "update_build.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _parse_build(text: str) -> dict[str, dict]:
  """Targets of a BUILD file: name -> {'kind': ..., **attributes}."""
  targets: dict[str, dict] = {}

  def rule(kind):
    def record(name, **attrs):
      assert name not in targets, f"duplicate target {name!r} in BUILD"
      targets[name] = {"kind": kind, **attrs}

    return record

  env = {
    "load": lambda *args: None,
    "package": lambda **kw: None,
    "glob": lambda patterns, **kw: [],
    "requirement": lambda name: f"@pypi//{name}",
    "True": True,
    "False": False,
    "__builtins__": {},
  }
  for kind in ("py_library", "py_binary", "py_test", "filegroup"):
    env[kind] = rule(kind)
  exec(compile(text, "BUILD", "exec"), env)  # pylint: disable=exec-used
  return targets


@pytest.fixture(scope="module")
def build_text() -> str:
  with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as f:
    return f.read()


@pytest.fixture(scope="module")
def targets(build_text) -> dict[str, dict]:
  return _parse_build(build_text)


def _repo_files(root: str, pattern: str) -> list[str]:
  paths = glob.glob(os.path.join(root, pattern), recursive=True)
  return sorted(
    os.path.relpath(p, root).replace(os.sep, "/") for p in paths if "__pycache__" not in p
  )


def _unlisted_modules(targets: dict[str, dict], root: str) -> list[str]:
  """Library modules on disk that no py_library names in its srcs."""
  named = {src for t in targets.values() if t["kind"] == "py_library" for src in t.get("srcs", [])}
  modules = [
    m
    for top in ("jaxspec", "pallas_kernels", "configs")
    for m in _repo_files(root, f"{top}/**/*.py")
  ]
  return [m for m in modules if m not in named]


def test_every_library_module_is_in_a_py_library(targets):
  assert _repo_files(ROOT, "jaxspec/**/*.py"), "no library modules found"
  missing = _unlisted_modules(targets, ROOT)
  assert not missing, f"modules missing from BUILD: {missing}; {FIX}"


def test_every_test_module_has_a_py_test(targets):
  tests = {t["main"]: name for name, t in targets.items() if t["kind"] == "py_test"}
  missing = [p for p in _repo_files(ROOT, "tests/**/test_*.py") if p not in tests]
  assert not missing, f"test modules without a py_test: {missing}; {FIX}"


def test_srcs_exist_and_deps_resolve(targets):
  for name, t in targets.items():
    for src in t.get("srcs", []):
      assert os.path.isfile(os.path.join(ROOT, src)), (
        f"{name} lists {src}, which does not exist; {FIX}"
      )
    for dep in t.get("deps", []) + t.get("data", []):
      if dep.startswith(":"):
        assert dep[1:] in targets, f"{name} depends on undefined {dep}"


def test_build_is_up_to_date(build_text):
  generated = _load_generator().render(ROOT)
  assert generated == build_text, f"BUILD is out of date; {FIX}"


def test_generator_sees_new_modules(tmp_path):
  """The check above would catch a module that BUILD does not name."""
  gen = _load_generator()
  pkg = tmp_path / "jaxspec" / "newpkg"
  pkg.mkdir(parents=True)
  (tmp_path / "jaxspec" / "__init__.py").write_text("from jaxspec import core\n")
  (tmp_path / "jaxspec" / "core.py").write_text("import numpy as np\n")
  (pkg / "__init__.py").write_text("")
  (pkg / "thing.py").write_text(
    "import os\nfrom .. import core\nfrom jaxspec.newpkg import other\nimport jax.numpy as jnp\n"
  )
  (pkg / "other.py").write_text("from absl import flags\n")
  (tmp_path / "tests").mkdir()
  (tmp_path / "tests" / "test_thing.py").write_text("from jaxspec.newpkg import thing\n")
  targets = _parse_build(gen.render(str(tmp_path)))
  lib = targets["jaxspec_newpkg"]
  assert lib["srcs"] == [
    "jaxspec/newpkg/__init__.py",
    "jaxspec/newpkg/other.py",
    "jaxspec/newpkg/thing.py",
  ]
  assert lib["deps"] == [":jaxspec_core", "@pypi//absl-py", "@pypi//jax"]
  assert targets["jaxspec"]["deps"] == [":jaxspec_core"]
  assert targets["test_thing"]["deps"] == [":jaxspec_newpkg", "@pypi//pytest"]
  assert not _unlisted_modules(targets, str(tmp_path))
  # A BUILD that lacks the module fails the coverage check.
  stale = gen.render(str(tmp_path)).replace('"jaxspec/newpkg/thing.py",', "")
  assert _unlisted_modules(_parse_build(stale), str(tmp_path)) == ["jaxspec/newpkg/thing.py"]


def test_generator_refuses_import_cycles(tmp_path):
  gen = _load_generator()
  for name, body in (("a", "from jaxspec.b import x\n"), ("b", "from jaxspec.a import y\n")):
    d = tmp_path / "jaxspec" / name
    d.mkdir(parents=True)
    (d / "__init__.py").write_text(body)
  with pytest.raises(gen.ImportCycleError, match="jaxspec_a, jaxspec_b"):
    gen.render(str(tmp_path))
