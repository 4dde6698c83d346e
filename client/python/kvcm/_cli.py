"""What every kvcm console script shares: the entry points, --version, deprecated flag and
TOML-key spellings (docs: one name per concept, old names warn once), and the message for a
script installed without its extra. Imports nothing of an extra at module level.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

# Extras of pyproject.toml ([project.optional-dependencies]) by the modules they bring.
_EXTRA_MODULES = {
    "bridge": ("zmq", "msgspec", "prometheus_client"),
    "router": ("aiohttp", "prometheus_client"),
}

_warned: set = set()


def warn_deprecated(prog: str, old: str, new: str) -> None:
    """One line on stderr, the first time `old` is used in this process."""
    if (prog, old) in _warned:
        return
    _warned.add((prog, old))
    print(f"{prog}: {old} is deprecated; use {new}", file=sys.stderr)


def rename_flags(argv: Sequence[str], aliases: Mapping[str, str], prog: str) -> List[str]:
    """argv with each deprecated --old (also --old-spelt-with-dashes, --old=value) replaced
    by its new name, warning once per old name. `aliases` maps "old" to "new", no dashes."""
    out = []
    for arg in argv:
        if arg == "--":
            out.extend(argv[len(out):])
            break
        name, eq, value = arg.partition("=")
        old = name[2:].replace("-", "_") if name.startswith("--") else ""
        if old in aliases:
            warn_deprecated(prog, f"--{name[2:]}", f"--{aliases[old]}")
            arg = f"--{aliases[old]}{eq}{value}"
        out.append(arg)
    return out


def rename_keys(table: Mapping[str, Any], aliases: Mapping[str, str], prog: str, where: str,
                warn: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """A settings table (TOML, a connector's extra config) with deprecated keys renamed,
    warning once each (through `warn` when given, else on stderr); ValueError when a key is
    given under both names."""
    out = dict(table)
    for old, new in aliases.items():
        if old in out:
            if new in out:
                raise ValueError(f"{where}: give {new}, not also its deprecated name {old}")
            if warn is None:
                warn_deprecated(prog, f"{where}: key {old!r}", repr(new))
            elif (prog, where, old) not in _warned:
                _warned.add((prog, where, old))
                warn(f"{prog}: {where}: key {old!r} is deprecated; use {new!r}")
            out[new] = out.pop(old)
    return out


def git_rev() -> str:
    """The commit this package was built from (setup.py records it in an installed copy),
    else the commit of the checkout it runs from, else "unknown"."""
    try:
        from kvcm._build_info import GIT_REV  # type: ignore[import-not-found]

        return str(GIT_REV)
    except ImportError:
        pass
    try:
        done = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse",
                               "--short=12", "HEAD"], capture_output=True, text=True,
                              timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def version_line(prog: str) -> str:
    """`<prog> <kvcm version> (git <rev>)`."""
    from kvcm import __version__

    return f"{prog} {__version__} (git {git_rev()})"


class VersionAction(argparse.Action):
    """--version: prints version_line(prog) and exits 0 (git is asked only then)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and exit", **kw)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(version_line(parser.prog))
        parser.exit(0)


def _missing_extra(e: ModuleNotFoundError) -> Optional[str]:
    top = (e.name or "").split(".")[0]
    for extra, modules in _EXTRA_MODULES.items():
        if top in modules:
            return extra
    return None


def run_script(prog: str, extra: str, module: str, argv: Optional[List[str]] = None) -> int:
    """Runs `module`.main(argv, prog=prog). Without the script's extra installed: a line
    naming the pip command, exit 2 (--version still answers)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--version" in argv:
        print(version_line(prog))
        return 0
    try:
        main: Callable[..., int] = importlib.import_module(module).main
    except ModuleNotFoundError as e:
        if _missing_extra(e) is None:
            raise
        # kvcm is installed from its source tree, not PyPI: name the path.
        print(f"{prog} needs the '{extra}' extra: from kvcm's source tree, "
              f"pip install './client/python[{extra}]' (no module {e.name!r})",
              file=sys.stderr)
        return 2
    return main(argv, prog=prog)


def router_main() -> int:
    return run_script("kvcm-router", "router", "kvcm.router.server")


def bridge_main() -> int:
    return run_script("kvcm-bridge", "bridge", "kvcm.engines.bridge")


def vllm_bridge_main() -> int:
    return run_script("kvcm-vllm-bridge", "bridge", "kvcm.engines.bridge")


__all__ = ["VersionAction", "bridge_main", "rename_flags", "rename_keys", "router_main",
           "run_script", "version_line", "vllm_bridge_main", "warn_deprecated"]
