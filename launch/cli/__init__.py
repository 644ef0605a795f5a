"""The entry point of jaxspec's command-line scripts: one-line errors instead of tracebacks.

`run(main)` replaces `absl.app.run(main)` in launch/*.py:

* a problem in what the user gave (a `jaxspec.JaxspecError`, an `app.UsageError`, a bad flag, a
  missing file or directory) prints one line, `jaxspec: error: <message>`, to stderr and exits
  with status 2; `--traceback` (alias `--verbose`) prints the full trace instead;
* Ctrl-C prints `jaxspec: interrupted` (with what was saved, when the interrupted code says) and
  exits with status 130, as shells do for SIGINT;
* `--help`, `--helpshort`, `--helpfull` print the usage text and exit with status 0 (absl: 1);
* any other exception is a bug in jaxspec and keeps its traceback.

It is a package under launch/, not a launch/*.py module, because the BUILD manifest
(tools/update_build.py) makes every launch/*.py a standalone `py_binary` that other scripts
cannot depend on, and every package under launch/ a `py_library` they can. For the same reason
the benchmarks behind `launch/bench.py` live in launch/benchmarks/, and the flags and defaults
several scripts share in launch/cli/common_flags.py and launch/cli/defaults.py. None of it is
part of the pip package: the scripts put the repository root on `sys.path` to import it.
"""

from __future__ import annotations

import functools
import sys
import traceback
from typing import Any, Callable, NoReturn, Sequence

from absl import app, flags

from jaxspec.errors import ConfigError, JaxspecError

PROG = "jaxspec"
EXIT_ERROR = 2  # bad usage or input, as argparse and most Unix tools report it
EXIT_INTERRUPTED = 130  # 128 + SIGINT

# Exceptions that report a problem in what the user gave, not a bug: one line each.
USER_ERRORS = (JaxspecError, app.UsageError, flags.Error, FileNotFoundError, NotADirectoryError)

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """Defines --traceback and its alias --verbose (absl's own are --verbosity / -v), once."""
  if "traceback" in FLAGS:
    return
  flags.DEFINE_bool(
    "traceback", False, "On an error, print the full traceback instead of one line."
  )
  flags.DEFINE_alias("verbose", "traceback")
  # Listed by --help (the main module's key flags), not only by --helpfull.
  for name in ("traceback", "verbose"):
    FLAGS.register_key_flag_for_module(sys.argv[0], FLAGS[name])


def one_line(message: str) -> str:
  """`message` on one line; a traceback quoted inside it shrinks to its last line."""
  lines = [line.strip() for line in str(message).splitlines() if line.strip()]
  if any(line.startswith("Traceback (most recent call last)") for line in lines):
    lines = [lines[0], lines[-1]]
  return " ".join(lines)


def describe(error: BaseException) -> str:
  """The one-line message for a user error."""
  if isinstance(error, OSError) and error.strerror and error.filename:
    return f"{error.strerror}: {error.filename}"
  return one_line(str(error)) or type(error).__name__


def _print_error(message: str) -> None:
  sys.stdout.flush()
  print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _traceback_requested(argv: Sequence[str] = ()) -> bool:
  if FLAGS.is_parsed():
    return bool(FLAGS.traceback)
  return any(a in ("--traceback", "--verbose") for a in argv)  # a flag failed to parse


def _config_field_error(error: BaseException) -> str | None:
  """The message of the KeyError behind a ConfigDict override of a missing field (say
  --config.train.num_step=3), or None when `error` is something else."""
  while error is not None:
    if isinstance(error, KeyError) and error.args and isinstance(error.args[0], str):
      return "; ".join(l.strip() for l in error.args[0].splitlines() if l.strip())
    error = error.__context__
  return None


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a flag error as one line (status 2) and --help as status 0."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    _print_error(f"error: {one_line(str(e))} (--help lists the flags)")
    sys.exit(EXIT_ERROR)
  except (AttributeError, KeyError) as e:
    # ml_collections reports an override of a config field that does not exist this way.
    field = _config_field_error(e)
    if field is None or _traceback_requested(argv):
      raise
    _print_error(f"error: no such config field {field}")
    sys.exit(EXIT_ERROR)
  except SystemExit as e:
    # absl's --help, --helpshort, --helpfull and --helpxml print the usage, then exit with 1:
    # nothing else exits while flags are parsed.
    if e.code == 1:
      sys.exit(0)
    raise


def _guarded(main: Callable[[list[str]], Any], argv: list[str]) -> Any:
  try:
    return main(argv)
  except KeyboardInterrupt as e:
    if _traceback_requested():
      traceback.print_exc()
    detail = one_line(str(e))
    _print_error("interrupted" + (f": {detail}" if detail else ""))
    sys.exit(EXIT_INTERRUPTED)
  except USER_ERRORS as e:
    if _traceback_requested():
      traceback.print_exc()
      sys.exit(EXIT_ERROR)
    _print_error(f"error: {describe(e)}")
    sys.exit(EXIT_ERROR)


def run(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None) -> NoReturn:
  """Runs `main(argv)` like `absl.app.run`, reporting user errors and Ctrl-C in one line."""
  _define_flags()
  app.run(
    functools.partial(_guarded, main),
    argv=None if argv is None else list(argv),
    flags_parser=_parse_flags,
  )
  raise AssertionError("absl.app.run returned")  # it always exits


def config_value(holder: Any) -> Any:
  """The value of an `ml_collections.config_flags` holder; a file that failed to load (which
  config_flags reports only when the value is read) is a `ConfigError`."""
  try:
    value = holder.value
    value.keys  # pylint: disable=pointless-statement  # a failed load raises on any access
    return value
  except OSError as e:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    raise ConfigError(f"cannot load --{holder.name}: {lines[-1] if lines else e}") from e


def require_fields(holder: Any, config: Any, names: Sequence[str], kind: str, example: str) -> None:
  """Raises a ConfigError naming the top-level `names` that `config` (the value of the config
  flag `holder`) lacks, say a target config given to the drafter trainer, where the run would
  otherwise stop at an AttributeError deep inside."""
  missing = [n for n in names if n not in config]
  if missing:
    raise ConfigError(
      f"{FLAGS[holder.name].serialize()} is not {kind}: it has no {', '.join(missing)} "
      f"(expected a config like --{holder.name}={example})"
    )
