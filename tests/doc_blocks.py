#!/usr/bin/env python3
"""Every command block in kvcm's documentation is run by a test or skipped by name.

A reader's promise: after the quick start (`./scripts/run.sh`, `./scripts/test.sh`), every
command block in README.md, docs/*.md, client/python/README.md and deploy/README.md runs as
written. This script finds the blocks and checks that each one is covered:

  * A fence's info string says what it holds. ```sh, ```bash, ```shell and ```console are
    commands (console: a transcript whose commands are the lines after "$ "); anything else
    (```text for output and synopses, ```toml, ```yaml, ```c++, ...) is not run. A fence with
    no info string, or an indented code block, is an error: say which one it is.
  * The last non-blank line before a command block is one of
        <!-- kvcm-doc: id=NAME -->          a test runs it (tests/doc_block_test.sh FILE NAME)
        <!-- kvcm-doc: skip REASON -->      no test can run it, for one of REASONS below
    NAME is unique within its file. A marker anywhere else is an error.
  * `check --build DIR` reads the tests that DIR's ctest registers
    (`ctest --show-only=json-v1`) and fails for a block with an id that no test runs, or a
    test that runs a block that does not exist.

  tests/doc_blocks.py check [--build BUILD_DIR] [--ctest CTEST]   # ctest doc_blocks_test
  tests/doc_blocks.py list [--build BUILD_DIR]                    # every block, and its cover
  tests/doc_blocks.py extract FILE NAME                           # the block's commands

Python 3 standard library only.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

COMMAND_LANGS = {"sh", "bash", "shell", "console"}

# Why a command block may go untested. Add one only when no test machine can run a block.
REASONS = {
    "quickstart": "the quick-start commands themselves, which every other block assumes ran",
    "needs-cluster": "needs a Kubernetes cluster or other machines",
    "needs-gpu": "needs an NVIDIA GPU (or a real model served on one)",
    "needs-docker": "needs a Docker daemon and a registry",
    "slow": "runs for many minutes or wants dedicated cores: a measurement whose figures a "
            "doc reports, a fuzzing campaign (a short form of it runs in ctest or test.sh)",
}

# Files whose indented code blocks are tolerated for now, with why. Remove an entry once the
# file fences its blocks.
INDENTED_OK = {
    "deploy/README.md": "its owner fences its blocks in the deploy change of issue 26",
}

MARKER = re.compile(r"^\s*<!--\s*kvcm-doc:\s*(.*?)\s*-->\s*$")
# CommonMark: a backtick fence's info string has no backtick (that line is inline code).
FENCE = re.compile(r"^(\s*)(`{3,}(?=[^`]*$)|~{3,})(.*)$")


def doc_files(root):
    files = ["README.md", "client/python/README.md", "deploy/README.md"]
    docs = os.path.join(root, "docs")
    if os.path.isdir(docs):
        files += sorted("docs/" + f for f in os.listdir(docs) if f.endswith(".md"))
    return [f for f in files if os.path.isfile(os.path.join(root, f))]


class Block:
    def __init__(self, path, line, lang, text, marker, marker_line):
        self.path, self.line, self.lang, self.text = path, line, lang, text
        self.marker, self.marker_line = marker, marker_line
        self.id = self.reason = None

    @property
    def is_command(self):
        return self.lang in COMMAND_LANGS

    def where(self):
        return f"{self.path}:{self.line}"

    def commands(self):
        """The text to run: the block, or a console transcript's commands."""
        if self.lang != "console":
            return self.text
        out, continued = [], False
        for line in self.text.splitlines():
            if continued or line.startswith("$ "):
                out.append(line if continued else line[2:])
                continued = line.endswith("\\")
        return "\n".join(out) + "\n"


def parse(root, path):
    """Returns (blocks, errors) of one markdown file."""
    with open(os.path.join(root, path), encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, errors = [], []
    pending = None  # (marker text, line) of the last non-blank line, if it was a marker
    i = 0
    prev_blank, prev_text = True, ""
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        marker = MARKER.match(line)
        if fence:
            indent, ticks, info = fence.groups()
            lang = info.strip().split()[0].lower() if info.strip() else ""
            body, j = [], i + 1
            while j < len(lines):
                close = FENCE.match(lines[j])
                if (close and close.group(2)[0] == ticks[0]
                        and len(close.group(2)) >= len(ticks) and not close.group(3).strip()):
                    break
                body.append(lines[j][len(indent):] if lines[j].startswith(indent) else
                            lines[j].lstrip())
                j += 1
            if j == len(lines):
                errors.append(f"{path}:{i + 1}: fence never closed")
            block = Block(path, i + 1, lang, "\n".join(body) + "\n",
                          pending[0] if pending else None, pending[1] if pending else None)
            if not lang:
                errors.append(f"{path}:{i + 1}: fence without a language: ```sh for commands "
                              "(with a kvcm-doc marker), ```text for output")
            blocks.append(block)
            pending = None
            i = j + 1
            prev_blank, prev_text = False, "```"
            continue
        if marker:
            if pending:
                errors.append(f"{path}:{pending[1]}: kvcm-doc marker not followed by a block")
            pending = (marker.group(1), i + 1)
        elif line.strip():
            if pending:
                errors.append(f"{path}:{pending[1]}: kvcm-doc marker not right before a "
                              "command block")
                pending = None
            if (prev_blank and re.match(r"^( {4,}|\t)\S", line)
                    and not re.match(r"^\s*([-*+]|\d+[.)])\s", prev_text)
                    and path not in INDENTED_OK):
                errors.append(f"{path}:{i + 1}: indented code block: fence it (```sh with a "
                              "kvcm-doc marker, or ```text)")
        if line.strip():
            prev_text = line if not line.startswith(" ") else prev_text
        prev_blank = not line.strip()
        i += 1
    if pending:
        errors.append(f"{path}:{pending[1]}: kvcm-doc marker not followed by a block")

    seen = {}
    for b in blocks:
        if b.marker is None:
            if b.is_command:
                errors.append(f"{b.where()}: ```{b.lang} block with no marker: add "
                              "<!-- kvcm-doc: id=NAME --> and a test that runs it, or "
                              "<!-- kvcm-doc: skip REASON --> (" + ", ".join(REASONS) + ")")
            continue
        if not b.is_command:
            errors.append(f"{path}:{b.marker_line}: kvcm-doc marker before a ```{b.lang} "
                          "block, which is not run")
            continue
        m = re.fullmatch(r"id=([A-Za-z0-9_.-]+)", b.marker)
        s = re.fullmatch(r"skip\s+(\S+)", b.marker)
        if m:
            b.id = m.group(1)
            if b.id in seen:
                errors.append(f"{b.where()}: id {b.id} is also the block at line {seen[b.id]}")
            seen[b.id] = b.line
        elif s and s.group(1) in REASONS:
            b.reason = s.group(1)
        else:
            errors.append(f"{path}:{b.marker_line}: bad marker '{b.marker}': id=NAME or "
                          "skip REASON (" + ", ".join(REASONS) + ")")
    return blocks, errors


def all_blocks(root):
    blocks, errors = [], []
    for path in doc_files(root):
        b, e = parse(root, path)
        blocks += b
        errors += e
    return blocks, errors


def registered(root, build, ctest):
    """{(file, id): [test names]} of the doc blocks BUILD's tests run.

    ctest lists them from a copy of BUILD's CTestTestfile.cmake tree: any ctest run in BUILD,
    even --show-only, rewrites BUILD/Testing/Temporary/LastTest.log, which would erase the
    output of the ctest run this check is part of."""
    with tempfile.TemporaryDirectory() as copy:
        for dirpath, _, files in os.walk(build):
            if "CTestTestfile.cmake" in files:
                target = os.path.join(copy, os.path.relpath(dirpath, build))
                os.makedirs(target, exist_ok=True)
                shutil.copy(os.path.join(dirpath, "CTestTestfile.cmake"), target)
        out = subprocess.run([ctest, "--test-dir", copy, "--show-only=json-v1"], check=True,
                             capture_output=True, text=True).stdout
    runs = {}
    for test in json.loads(out).get("tests", []):
        cmd = test.get("command") or []
        for k, arg in enumerate(cmd):
            if os.path.basename(arg) != "doc_block_test.sh":
                continue
            args = [a for a in cmd[k + 1:] if not a.startswith("--")]
            if len(args) < 2:
                continue
            path = os.path.relpath(os.path.realpath(args[0]), os.path.realpath(root))
            runs.setdefault((path, args[1]), []).append(test["name"])
    return runs


def main():
    here = os.path.dirname(os.path.realpath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["check", "list", "extract"])
    parser.add_argument("args", nargs="*", help="extract: FILE NAME")
    parser.add_argument("--root", default=os.path.dirname(here), help="the source tree")
    parser.add_argument("--build", help="a configured build directory: check which blocks "
                        "its ctest runs")
    parser.add_argument("--ctest", default="ctest")
    opts = parser.parse_args()
    root = opts.root

    if opts.command == "extract":
        if len(opts.args) != 2:
            parser.error("extract FILE NAME")
        path = os.path.relpath(os.path.realpath(opts.args[0]), os.path.realpath(root))
        blocks, _ = parse(root, path)
        for b in blocks:
            if b.id == opts.args[1]:
                sys.stdout.write(b.commands())
                return 0
        print(f"{path}: no block <!-- kvcm-doc: id={opts.args[1]} -->", file=sys.stderr)
        return 1

    blocks, errors = all_blocks(root)
    runs = registered(root, opts.build, opts.ctest) if opts.build else None
    if runs is not None:
        ids = {(b.path, b.id) for b in blocks if b.id}
        for b in blocks:
            if b.id and (b.path, b.id) not in runs:
                errors.append(f"{b.where()}: no test runs block id={b.id} (register one in "
                              "tests/CMakeLists.txt with kvcm_doc_test)")
        for (path, name), tests in sorted(runs.items()):
            if (path, name) not in ids:
                errors.append(f"{', '.join(tests)}: runs {path} id={name}, which is not there")

    if opts.command == "list":
        for b in blocks:
            if not b.is_command:
                continue
            cover = (f"test {','.join(runs.get((b.path, b.id), ['?']))}" if b.id and runs
                     else f"id={b.id}" if b.id else f"skip {b.reason}")
            print(f"{b.where()}\t{cover}")
    commands = [b for b in blocks if b.is_command]
    if errors:
        print("\n".join(errors), file=sys.stderr)
        print(f"doc_blocks: {len(errors)} problem(s) in {len(commands)} command blocks",
              file=sys.stderr)
        return 1
    if opts.command == "check":
        skipped = sum(1 for b in commands if b.reason)
        print(f"doc_blocks: {len(commands)} command blocks: {len(commands) - skipped} run by "
              f"tests{'' if runs is not None else ' (not checked: no --build)'}, "
              f"{skipped} skipped by name")
    return 0


if __name__ == "__main__":
    sys.exit(main())
