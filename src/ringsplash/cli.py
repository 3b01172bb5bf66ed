"""Command-line flags derived from a frozen config dataclass (experiments and scripts)."""

import argparse
import dataclasses
import typing


def _flag_type(field: dataclasses.Field):
    if field.default is not None:
        return type(field.default)
    # a None default: parse as the first non-None type of an `X | None` annotation
    args = [a for a in typing.get_args(field.type) if a is not type(None)]
    return args[0] if args and isinstance(args[0], type) else str


def parse_config(config_cls, argv=None, *, description: str | None = None):
    """``config_cls(**flags)``: one ``--field-name`` flag per field, defaults from the class
    (``--flag/--no-flag`` for booleans), so ``--help`` lists every option with its default."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(config_cls):
        flag = "--" + field.name.replace("_", "-")
        if isinstance(field.default, bool):
            parser.add_argument(flag, dest=field.name, default=field.default, action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(flag, dest=field.name, type=_flag_type(field), default=field.default,
                                help=f"(default: {field.default!r})")
    return config_cls(**vars(parser.parse_args(argv)))


