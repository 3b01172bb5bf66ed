"""Command-line flags derived from a frozen config dataclass (experiments and scripts).

Each field becomes a ``--field-name`` flag whose help line is the field's own comment in the
class source — a trailing ``# ...`` on the field's line, else ``#:`` lines right above it, else
the field's entry in the class docstring (``name: text`` / ``* ``name`` — text``) — plus its
default. A field with a comment-free line gets an empty help; the tests refuse that.

Every parser refuses abbreviated flags (``allow_abbrev=False``): ``--data x`` is an unknown
argument, never a prefix of ``--data-parallel``.
"""

import argparse
import ast
import contextlib
import dataclasses
import functools
import inspect
import io
import math
import os
import re
import sys
import textwrap
import tokenize
import typing
from collections.abc import Mapping

# a field described in a class docstring: "name: text", "``name``: text", "* ``name`` — text",
# ":param name: text", "name (int): text"
_DOC_FIELD = re.compile(
    r"^\s*(?:[*-]\s+)?(?::(?:param|ivar)\s+)?(?:``)?(?P<name>[A-Za-z_]\w*)(?:``)?(?:\s*\([\w.\[\]|, ]*\))?"
    r"\s*(?::|—|--?)\s+(?P<text>\S.*)$"
)


def _flag_type(field: dataclasses.Field):
    if field.default is not None:
        return type(field.default)
    # a None default: parse as the first non-None type of an `X | None` annotation
    args = [a for a in typing.get_args(field.type) if a is not type(None)]
    return args[0] if args and isinstance(args[0], type) else str


def _comment_text(comment: str) -> str:
    return comment.lstrip("#").lstrip(":").strip()


def _docstring_fields(doc: str) -> dict[str, str]:
    found = {}
    for line in doc.splitlines():
        m = _DOC_FIELD.match(line)
        if m and m["name"] not in found:
            found[m["name"]] = m["text"].strip()
    return found


def _class_field_comments(cls) -> dict[str, str]:
    """``{field: help}`` from the comments next to the fields in ``cls``'s own source
    ({} when the source cannot be read or parsed, e.g. a class made by ``exec``)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        tree = ast.parse(source)
        comments = {}  # line -> (text, whether the comment is the whole line)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = (tok.string, not tok.line[: tok.start[1]].strip())
    except (OSError, TypeError, SyntaxError, tokenize.TokenError, IndentationError):
        return {}
    classdef = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
    if classdef is None:
        return {}
    documented = _docstring_fields(ast.get_docstring(classdef) or "")
    helps = {}
    for node in classdef.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = [_comment_text(comments[ln][0]) for ln in range(node.lineno, node.end_lineno + 1)
                    if ln in comments and not comments[ln][1]]
        above, ln = [], node.lineno - 1
        while ln in comments and comments[ln][1] and comments[ln][0].startswith("#:"):
            above.insert(0, _comment_text(comments[ln][0]))
            ln -= 1
        name = node.target.id
        helps[name] = " ".join(t for t in trailing if t) or " ".join(t for t in above if t) or documented.get(name, "")
    return helps


@functools.cache
def field_help(config_cls) -> dict[str, str]:
    """``{field name: its comment}`` for every field of the dataclass ``config_cls`` (base classes'
    comments for inherited fields; "" where a field has none). Cached per class."""
    helps: dict[str, str] = {}
    for cls in reversed(config_cls.__mro__):
        if dataclasses.is_dataclass(cls):
            helps.update({k: v for k, v in _class_field_comments(cls).items() if v or k not in helps})
    return {f.name: helps.get(f.name, "") for f in dataclasses.fields(config_cls)}


def _preset_defaults(config_cls, argv, presets: Mapping, parser: argparse.ArgumentParser) -> dict:
    """The chosen preset's values for the fields ``config_cls`` has."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    if "preset" not in fields:
        raise TypeError(f"{config_cls.__name__} needs a `preset` field to take presets")
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset", default=fields["preset"].default)
    chosen = pre.parse_known_args(argv)[0].preset
    if not chosen:
        return {}
    if chosen not in presets:
        parser.error(f"argument --preset: unknown preset {chosen!r}: choose one of {tuple(presets)}")
    values = presets[chosen]
    values = values.fields() if hasattr(values, "fields") else dict(values)
    return {k: v for k, v in values.items() if k in fields}


def config_parser(config_cls, argv=None, *, description: str | None = None,
                  presets: Mapping | None = None) -> argparse.ArgumentParser:
    """The ``argparse`` parser ``parse_config`` uses (``argv`` only picks the preset's defaults)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    defaults = _preset_defaults(config_cls, argv, presets, parser) if presets is not None else {}
    helps = field_help(config_cls)
    for field in dataclasses.fields(config_cls):
        flag = "--" + field.name.replace("_", "-")
        default = defaults.get(field.name, field.default)
        if isinstance(field.default, bool):
            action = parser.add_argument(flag, dest=field.name, default=default,
                                         action=argparse.BooleanOptionalAction)
        else:
            action = parser.add_argument(flag, dest=field.name, type=_flag_type(field), default=default)
        # set after construction: BooleanOptionalAction (Python < 3.13) appends its own default
        text = helps[field.name].replace("%", "%%")
        action.help = f"{text} (default: {default!r})" if text else f"(default: {default!r})"
    return parser


def parse_config(config_cls, argv=None, *, description: str | None = None, presets: Mapping | None = None):
    """``config_cls(**flags)``: one ``--field-name`` flag per field, defaults from the class
    (``--flag/--no-flag`` for booleans), so ``--help`` lists every option with its comment
    (``field_help``) and default. Abbreviated flags are refused.

    With ``presets`` (name -> object with ``fields()`` or a mapping of field values, e.g.
    ``ringsplash.model.presets.PRESETS``) ``config_cls`` must have a ``preset`` field:
    ``--preset NAME`` makes that preset's values the defaults of the fields ``config_cls`` has
    (others are ignored) and explicit flags still override them; an empty name = no preset.
    """
    parser = config_parser(config_cls, argv, description=description, presets=presets)
    return config_cls(**vars(parser.parse_args(argv)))


def check_choices(config, choices: Mapping[str, tuple]) -> None:
    """Raise unless every field ``name`` of ``config`` is one of ``choices[name]``; the error names
    the field (``--name`` on the command line), what was expected and what was given."""
    for name, allowed in choices.items():
        value = getattr(config, name)
        if isinstance(value, bool) or value not in tuple(allowed):
            raise ValueError(f"{name} must be one of {tuple(allowed)}, got {name}={value!r}")


# ------------------------------------------------------------------------------------ one-line errors


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def flag_error(name: str, value, accepted: str) -> ValueError:
    """The error of a bad flag: it names the flag, the value given and what is accepted."""
    return ValueError(f"{_flag(name)} {value!r} is not accepted: expected {accepted}")


def check_flags(config, *, choices: dict | None = None, positive: tuple = (), non_negative: tuple = (),
                positive_numbers: tuple = (), non_negative_numbers: tuple = (), fractions: tuple = ()) -> None:
    """Raise ``flag_error`` for the first field of ``config`` outside its ``choices`` / not an int
    ``>= 1`` (``positive``) / ``>= 0`` (``non_negative``) / not a finite number ``> 0``
    (``positive_numbers``) / ``>= 0`` (``non_negative_numbers``) / not in ``(0, 1]`` (``fractions``).
    NaN and infinities are refused wherever a number is taken."""
    for name, allowed in (choices or {}).items():
        value = getattr(config, name)
        if isinstance(value, bool) or value not in tuple(allowed):
            raise flag_error(name, value, f"one of {', '.join(map(str, allowed))}")
    for names, minimum in ((positive, 1), (non_negative, 0)):
        for name in names:
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise flag_error(name, value, f"an integer >= {minimum}")
    for names, inside, accepted in ((positive_numbers, lambda x: x > 0, "a finite number > 0"),
                                    (non_negative_numbers, lambda x: x >= 0, "a finite number >= 0"),
                                    (fractions, lambda x: 0 < x <= 1, "a number in (0, 1]")):
        for name in names:
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or not inside(value):
                raise flag_error(name, value, accepted)


def check_optional_flags(config, *, unset, positive_numbers: tuple = ()) -> None:
    """``check_flags(config, positive_numbers=...)`` for the fields not at their ``unset`` value (0 or None:
    "off")."""
    check_flags(config, positive_numbers=tuple(n for n in positive_numbers if getattr(config, n) != unset))


#: the flags naming directories a run writes to (a script's config has some of them)
OUTPUT_DIRS = ("run_dir", "corpus_dir", "out")
#: what a bad path given on the command line raises (a missing file, a file where a directory must be, ...)
PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError)


def output_dir_problem(path: str) -> str | None:
    """Why no directory can be made at ``path`` (None: it is one, or one can be made): its nearest existing
    ancestor (itself included) is not a directory. Checked up front: a run would fail only once it writes."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if os.path.isdir(existing):
        return None
    return f"{path!r} is a file" if existing == os.path.abspath(path) else f"{existing!r} (above {path!r}) is a file"


def check_output_dirs(config, names: tuple = OUTPUT_DIRS) -> None:
    """Each of ``config``'s ``names`` that is set must be a directory or a path where one can be made
    (``output_dir_problem``), else ``flag_error`` naming the flag."""
    for name in names:
        path = getattr(config, name, "")
        problem = output_dir_problem(path) if path else None
        if problem:
            raise flag_error(name, path, f"a directory (or a path where one can be made): {problem}")


@contextlib.contextmanager
def _one_line_argparse_errors():
    """argparse's errors (unknown flag, a value of the wrong type, an unknown preset) as one line,
    without the usage block above it."""

    def error(parser, message):
        parser.exit(2, f"{parser.prog}: error: {message} (--help lists every flag)\n")

    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original


def run_script(main, parse_args, argv=None):
    """``main(parse_args(argv))`` from the command line: a bad flag, output directory or input path is one
    line on stderr (``<script>: error: ...``, exit status 2), never a traceback; so is an optional package the
    run needs and does not find (exit status 1, the line names the extra to install); ``main``'s result otherwise."""
    prog = os.path.basename(sys.argv[0])
    with _one_line_argparse_errors():
        try:
            config = parse_args(argv)
            check_output_dirs(config)
        except (ValueError, TypeError) as e:  # the config's own checks (each names its flag)
            sys.exit(_one_line(prog, e))
    from ringsplash._internal.optional import MissingDependency

    try:
        return main(config)
    except (ValueError, *PATH_ERRORS) as e:  # bad input found while setting up (a config check, a path)
        sys.exit(_one_line(prog, e))
    except MissingDependency as e:  # an optional package the run needs: one line naming what to install
        _one_line(prog, e)
        sys.exit(1)


def _one_line(prog: str, error: BaseException) -> int:
    print(f"{prog}: error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
    return 2
