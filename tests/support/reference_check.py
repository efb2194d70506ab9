"""The checker behind tests/project/test_references.py: the names a text gives to files,
modules and names of the tree, and which of them the tree no longer has.

A `Text` is one docstring, one file's comments, one page of docs, or pyproject.toml, with
the checks that suit it (`checks`) and, for a module's docstrings and comments, the names
its own code uses (`local`). The checks, each a kind of name that goes stale when a module
moves or is renamed:

- `backticks`: a backticked `NAME.py`, `DIR/NAME.py`, `NAME.cpp` (also with `: Name`
  after it) is a file of the tree; `aici_cli.dotted.path` a module (or a name in it);
  `module.Name` whose first part is snake_case names a module of aici_cli (any package)
  that defines `Name`, an importable top-level module, or one of `NOT_MODULES` (a name
  with a data file's suffix, `NAME.json`, is a file, maybe one a command writes).
- `folders`: a backticked `NAME/` is a folder of the tree, or one the tool makes
  (`RUNTIME_FOLDERS`); in the package's texts only (the docs name the folders a command
  writes).
- `paths`: a path, backticked or not, when it is clearly one: `DIR/NAME.py` (resolved as
  above), or a path whose first part is a folder of the checkout (`aici_cli/`, `tests/`,
  `bench/`, ...) or a package of aici_cli (`control/wasm`), which must exist there (a path
  .gitignore names is written by a command, and `aici_cli/schemas` is pyproject.toml's
  `package-dir` for `schemas/`). A part in capitals or of one letter (`tests/X/`,
  `NAME.py`, `x.py`) is a placeholder, and a URL is not a path.
- `files`: a bare file name, backticked or not (`NAME.py`), is a file of the tree, or of
  the standard library.
- `words`: a backticked bare snake_case word (`files`, `cli_run_options`), or a compound
  one alone in parentheses (`(kernel_run)`), reads as a module or a name: it must be a
  module or package of the tree, a top-level name of aici_cli or the guest SDK, a name or
  string the text's own module uses, or one of `NOT_NAMES` (other projects' names, the
  words of the formats). A compound word (with `_`) may also be any name or string of the
  checkout's code (a fixture, a mark, a JSON field): such words are specific enough that
  a use anywhere is the thing named. A plain word (`files`) must be known in its own
  module: elsewhere it is likely another thing of the same name (a field `files`).
- `dotted`: a bare `aici_cli.dotted.path` (pyproject.toml's strings) is a module.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import inspect
import keyword
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from functools import cache
from pathlib import Path

from paths import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PACKAGE = ROOT / "aici_cli"
SOURCE_DIRS = ("aici_cli", "controllers", "tests", "bench", "schemas", "wit", "examples")
CODE_DIRS = ("aici_cli", "controllers", "tests", "bench")  # comments and docstrings read
DOCS = (*sorted((ROOT / "docs").glob("*.md")), ROOT / "ARCHITECTURE.md", ROOT / "README.md")
ALL_CHECKS = frozenset({"backticks", "folders", "paths", "files", "words", "dotted"})

# `x.y` in the docs where x is not a module: fields of results and stats, attributes of
# objects, other projects' modules, OpenTelemetry and WIT names.
NOT_MODULES = frozenset({
    "aici", "stats", "gen_ai", "structured_outputs", "info", "component", "js", "error",
    "yes_no", "vote", "state", "host", "model", "controller", "config", "profile",
    "storage", "python", "signatures", "lm", "self", "cls", "args", "line", "result",
    "results", "step", "summary", "usage", "response", "request", "body", "choices",
    "message", "tool_calls", "nn", "cpu", "ops", "backends", "cuda", "np", "layer",
    "made_with", "stats_out", "options", "run", "engine", "generation", "branch", "fork",
    "x", "y", "out", "wasi", "aici_controller", "job", "spec", "verdict", "mode", "shapes",
    "chunk", "worker", "ray", "tokenizer", "seq", "runner", "sampling", "output",
    "logprobs", "custom", "top_logprobs", "matcher", "schema", "lark", "guest", "trace",
    "span", "meta", "ci", "gate", "baseline", "report", "junit", "markdown", "cache",
    "tokenizer_config", "gguf", "wit_world", "str", "segment",
    "memory", "table", "inputs", "plan", "vocabulary", "console", "prompt_tokens_details",
    "org", "libllama", "session", "testing", "content",
})

# Backticked words that are not this project's names: option values, other formats'
# fields, WIT names, other projects' functions, and words of the prose
# (`needless_not_names` keeps the list to the words some text needs).
NOT_NAMES = frozenset({
    # option values and JSON values
    "auto", "none", "true", "always", "latest", "valid", "ready", "keep", "tune",
    # JSON Schema's, OpenAI's and lm-eval's fields and names
    "pattern", "properties", "required", "dependencies", "contains", "definations",
    "choices", "parameters", "arguments", "n", "prompt", "meta", "hf", "generate", "answer",
    "is_greedy", "_encode_pair",
    # WIT and the guest's words
    "err", "runner", "start", "trace", "provide", "stats", "splice",
    # other projects: transformers, x86, pytest, MCP, ours
    "sliding_attention_inv_freq", "vmovdqa", "norecursedirs", "mcp", "aici", "pid",
    # words of the prose: a placeholder, a pattern's parts, a row's index, a knob
    "p", "then", "_self_self_self", "chunk_i", "cap", "bucket", "lookahead",
})

# Folders the tool makes at run time: the cache's compiled components, the SDK copied into
# a Python controller's build.
RUNTIME_FOLDERS = frozenset({"components", "__aici_sdk__"})

REFERENCE = re.compile(r"`([^`\n]+)`")
DATA_SUFFIXES = frozenset({"json", "jsonl", "md", "toml", "yml", "yaml", "txt", "html", "svg",
                           "csv", "wasm", "cwasm", "wit", "gguf", "safetensors", "sh", "log"})
FOLDER_REF = re.compile(r"\.?[\w.-]+/")
FILE_REF = re.compile(r"([\w./-]*\w\.(?:py|cpp|c|h))(?:\s*:\s*\w[\w.]*)?")
DOTTED_REF = re.compile(r"([a-z_][a-z0-9_]*)\.([A-Za-z_]\w*)(?:\.\w+)*(?:\(\))?")
PATH_WORD = re.compile(r"(?<![\w./<>*{}$:@~-])((?:\.?\w[\w.-]*/)+(?:\w[\w.-]*\w)?)(?![\w/<*{])")
FILE_WORD = re.compile(r"(?<![\w./<>*{}$:@~/-])(\w+\.py)\b(?![/(])")
DOTTED_WORD = re.compile(r"(?<![\w.])(aici_cli(?:\.\w+)+)")
BARE_WORD = re.compile(r"`([a-z_][a-z0-9_]*)`")
ALONE_IN_PARENS = re.compile(r"\(([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\)")
URL = re.compile(r"\w+://\S+")
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*|[a-z])(?:\.\w+)?$")  # NAME.py, X/, x.py
CODE_SUFFIX = re.compile(r"\.(?:py|cpp|c)$")
IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class Text:
    where: str
    text: str
    checks: frozenset[str]
    local: frozenset[str] = frozenset()  # the names and strings of the text's own module


# ------------------------------------------------------------------------ what the tree has
@cache
def files() -> frozenset[str]:
    found: set[str] = set()
    for top in SOURCE_DIRS:
        for path in (ROOT / top).rglob("*"):
            if path.suffix in (".py", ".cpp", ".c", ".h") and "node_modules" not in path.parts:
                found.add(str(path.relative_to(ROOT)))
    return frozenset(found)


@cache
def folders() -> frozenset[str]:
    """The name of every folder of the checkout's sources and docs."""
    found = {p.name for p in ROOT.iterdir() if p.is_dir()}
    for top in (*SOURCE_DIRS, "docs", ".ci"):
        found |= {p.name for p in (ROOT / top).rglob("*") if p.is_dir()
                  and "node_modules" not in p.parts and "__pycache__" not in p.parts}
    return frozenset(found)


@cache
def modules() -> dict[str, list[Path]]:
    """Module basename -> its files (a package by its folder's name, as `engine`)."""
    found: dict[str, list[Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = path.parent.name if path.name == "__init__.py" else path.stem
        found.setdefault(name, []).append(path)
    return found


@dataclass(frozen=True)
class Source:
    """What one Python file says and uses, read with one regular expression over its text
    (~1.3 ms a file; parsing it costs three times that): its docstrings (the strings that
    open the file or a block), its comments, the names of its code, and the words of its
    other strings."""

    docstrings: tuple[str, ...]
    comments: str
    names: frozenset[str]  # every name its code binds, reads or imports
    strings: frozenset[str]  # the words of its short strings, the compound words of the rest


# A string (skipped whole, so that a `#` inside one starts no comment) or a comment.
STRING_OR_COMMENT = re.compile(r"""
    (?P<prefix>[rRbBuUfF]{0,2})
    (?P<string> \"\"\"[\s\S]*?\"\"\" | '''[\s\S]*?''' | "(?:[^"\\\n]|\\.)*" | '(?:[^'\\\n]|\\.)*' )
    | (?P<comment>\#[^\n]*)""", re.VERBOSE)


def _opens_a_body(text: str, start: int) -> bool:
    """Whether the string at `start` is the first statement of the file or of a block: on
    a line of its own, after a line that ends in `:` (a dict's value follows its key on
    the key's line)."""
    before = text[max(0, start - 400):start].rstrip(" \t")
    header = before.rstrip().rpartition("\n")[2].partition("#")[0].rstrip()
    if before.endswith("\n") and header.endswith(":"):
        return True
    return all(not line.strip() or line.lstrip().startswith("#")
               for line in text[:start].splitlines())


@cache
def source(path: Path) -> Source:
    text = path.read_text()
    docs: list[str] = []
    comments: list[str] = []
    code: list[str] = []
    strings: set[str] = set()
    end = 0
    for match in STRING_OR_COMMENT.finditer(text):
        code.append(text[end:match.start()])
        end = match.end()
        if match.group("comment"):
            comments.append(match.group("comment"))
            continue
        body = match.group("string")
        body = body[3:-3] if body[:3] in ('"""', "'''") else body[1:-1]
        if _opens_a_body(text, match.start()) and "f" not in match.group("prefix").lower():
            docs.append(inspect.cleandoc(body))
        else:  # a long string is prose: only its compound words are names
            strings.update(word for word in IDENTIFIER.findall(body)
                           if len(body) < 40 or "_" in word.strip("_"))
    code.append(text[end:])
    names = frozenset(IDENTIFIER.findall(" ".join(code)))
    return Source(tuple(docs), "\n".join(comments), names, frozenset(strings))


def uses(path: Path) -> frozenset[str]:
    """Every name a module's code binds, reads or imports, and the words of its strings
    (JSON fields, error kinds, option values)."""
    return source(path).names | source(path).strings


@cache
def tree_modules() -> frozenset[str]:
    """Every module and package name of the checkout's Python code."""
    names: set[str] = set()
    for top in CODE_DIRS:
        for path in (ROOT / top).rglob("*.py"):
            if "node_modules" not in path.parts:
                names |= {path.stem, path.parent.name}
    return frozenset(names)


@cache
def defines(path: Path) -> frozenset[str]:
    """The names a module defines or imports at its top level, and its classes' members
    (so `module.Class.method` and a re-exported name resolve too)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if path.name == "__init__.py":
        names |= {p.stem for p in path.parent.glob("*.py")}
        names |= {p.name for p in path.parent.iterdir() if (p / "__init__.py").is_file()}
    return frozenset(names)


def _sdk_and_package() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *(ROOT / "controllers").glob("aici_controller/*.py")])


@cache
def top_names() -> frozenset[str]:
    return frozenset().union(*(defines(p) for p in _sdk_and_package()))


@cache
def used_names() -> frozenset[str]:
    """The names and strings of the checkout's code (fixtures, marks, the fields a bench
    writes), but the strings of the checks themselves (tests/project and this module),
    which hold stale names and allowed words on purpose."""
    code = [p for top in ("tests", "bench") for p in (ROOT / top).rglob("*.py")]
    checks = [p for p in code if "project" in p.parts or p == Path(__file__).resolve()]
    return frozenset().union(*(uses(p) for p in _sdk_and_package()),
                             *(source(p).names if p in checks else uses(p) for p in code))


@cache
def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@cache
def _ignored() -> tuple[str, ...]:
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return tuple(line.strip("/") for line in lines if line and not line.startswith("#"))


@cache
def _package_dirs() -> dict[str, str]:
    """pyproject.toml's `package-dir`: where a package of the wheel lives in the checkout
    (`aici_cli/schemas` is `schemas`)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {name.replace(".", "/"): folder for name, folder in mapping.items()}


# ------------------------------------------------------------------------ one name's problem
def file_problem(ref: str) -> str | None:
    name = ref.lstrip("./")
    if any(f == name or f.endswith("/" + name) for f in files()):
        return None
    return "no such file"


def folder_problem(name: str) -> str | None:
    if PLACEHOLDER.match(name) or name in folders() or name in RUNTIME_FOLDERS:
        return None
    return "no such folder"


def dotted_problem(ref: str) -> str | None:
    folder = _package_dirs().get(ref.replace(".", "/"))
    if folder is not None:  # a package of the wheel that is a folder of the checkout
        return None if (ROOT / folder).is_dir() else "no such folder"
    if ref.startswith("aici_cli."):
        parts = ref.removesuffix("()").split(".")
        for cut in range(len(parts), 0, -1):
            path = PACKAGE.parent.joinpath(*parts[:cut])
            origin = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
            if origin.is_file():
                rest = parts[cut:]
                return None if not rest or rest[0] in defines(origin) else "no such name"
        return "no such module"
    match = DOTTED_REF.fullmatch(ref)
    if match is None:
        return None
    module, name = match.group(1), match.group(2)
    if module in modules():
        if any(name in defines(path) for path in modules()[module]) \
                or module in NOT_MODULES:
            return None
        return f"{module} defines no {name}"
    if module in NOT_MODULES or _importable(module):
        return None
    return f"no module named {module}"


def path_problem(ref: str) -> str | None:
    """A path of the checkout (or of aici_cli) that is not there; None for a word that is
    not clearly a path."""
    path = ref.rstrip(".").rstrip("/").removeprefix("./")
    parts = path.split("/")
    if any(PLACEHOLDER.match(part) for part in parts):
        return None
    if CODE_SUFFIX.search(path):
        return file_problem(path)
    for prefix, folder in _package_dirs().items():
        if path == prefix or path.startswith(prefix + "/"):
            path = folder + path[len(prefix):]
    if (ROOT / parts[0]).is_dir():
        base = ROOT
    elif (PACKAGE / parts[0] / "__init__.py").is_file():
        base = PACKAGE
    else:
        return None
    if any(path == pattern or path.startswith(pattern + "/") or fnmatch(path, pattern)
           for pattern in _ignored()):
        return None  # written by a command
    if (base / path).exists():
        return None
    # `control/grammar_check.support_problem`: a module's file and a name in it
    head, _, name = path.rpartition("/")
    module, dot, _attr = name.partition(".")
    if dot and (base / head / (module + ".py")).is_file():
        return None
    return "no such path"


def word_problem(word: str, local: frozenset[str],
                 allowed: frozenset[str] = NOT_NAMES) -> str | None:
    """A bare word that reads as a module or a name and is neither (see the module's
    docstring, `words`)."""
    if word in tree_modules() or word in top_names() or word in local or word in allowed \
            or keyword.iskeyword(word) or hasattr(builtins, word):
        return None
    if "_" in word.strip("_") and word in used_names():
        return None
    return "no module or name of that name"


# ------------------------------------------------------------------------ one text's problems
def _backticked(text: str, folders: bool) -> Iterator[tuple[str, str | None]]:
    for ref in REFERENCE.findall(text):
        ref = ref.strip()
        file_ref = FILE_REF.fullmatch(ref)
        if file_ref:
            yield ref, file_problem(file_ref.group(1))
        elif FOLDER_REF.fullmatch(ref):
            if folders:
                yield ref, folder_problem(ref.rstrip("/"))
        elif ref.rpartition(".")[2] not in DATA_SUFFIXES:  # `figures.json`: not a module
            yield ref, dotted_problem(ref)


def _words(text: str, local: frozenset[str],
           allowed: frozenset[str] = NOT_NAMES) -> Iterator[tuple[str, str | None]]:
    for word in [*BARE_WORD.findall(text), *ALONE_IN_PARENS.findall(text)]:
        yield word, word_problem(word, local, allowed)


def problems_in(text: Text) -> list[str]:
    """`where: name: problem` for each stale name in `text`, by its checks."""
    found: list[tuple[str, str | None]] = []
    checks, body = text.checks, URL.sub(" ", text.text)
    if "backticks" in checks:
        found += _backticked(body, folders="folders" in checks)
    if "paths" in checks:
        found += ((word, path_problem(word)) for word in PATH_WORD.findall(body))
    if "files" in checks:
        found += ((word, file_problem(word)) for word in FILE_WORD.findall(body)
                  if not PLACEHOLDER.match(word)
                  and word.removesuffix(".py") not in sys.stdlib_module_names)
    if "words" in checks:
        found += _words(body, text.local)
    if "dotted" in checks:
        found += ((word, dotted_problem(word)) for word in DOTTED_WORD.findall(body))
    seen: dict[str, None] = {}
    for name, problem in found:
        if problem:
            seen.setdefault(f"{text.where}: `{name}`: {problem}")
    return list(seen)


# ------------------------------------------------------------------------ the tree's texts
def texts() -> Iterator[Text]:
    """aici_cli's docstrings and comments (every check), the docstrings and comments of the
    tests, the benches and the guest SDK (paths and file names), the docs (the backticked
    references and paths; their bare words are option values and the fields of outputs,
    some of them made at run time) and pyproject.toml (paths, file names, modules)."""
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "node_modules" in path.parts:
                continue
            where = str(path.relative_to(ROOT))
            package = top == "aici_cli"
            checks = ALL_CHECKS - {"dotted"} if package else frozenset({"paths", "files"})
            local = uses(path) if package else frozenset()
            for doc in source(path).docstrings:
                yield Text(where, doc, checks, local)
            yield Text(where, source(path).comments, checks, local)
    for path in DOCS:
        yield Text(str(path.relative_to(ROOT)), path.read_text(),
                   frozenset({"backticks", "paths"}))
    yield Text("pyproject.toml", (ROOT / "pyproject.toml").read_text(),
               frozenset({"paths", "files", "dotted"}))


def stale_references(given: Iterable[Text] | None = None) -> list[str]:
    return [problem for text in (texts() if given is None else given)
            for problem in problems_in(text)]


def needless_not_names() -> list[str]:
    """The words of `NOT_NAMES` that no text needs (none names them, or each that does
    resolves without the list): the list holds only what the tree's texts say."""
    needed: set[str] = set()
    for text in texts():
        if "words" in text.checks:
            words = _words(URL.sub(" ", text.text), text.local, allowed=frozenset())
            needed |= {word for word, problem in words if problem}
    return sorted(NOT_NAMES - needed)
