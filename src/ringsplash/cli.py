"""Command-line flags derived from a frozen config dataclass (experiments and scripts)."""

import argparse
import dataclasses
import typing
from collections.abc import Mapping


def _flag_type(field: dataclasses.Field):
    if field.default is not None:
        return type(field.default)
    # a None default: parse as the first non-None type of an `X | None` annotation
    args = [a for a in typing.get_args(field.type) if a is not type(None)]
    return args[0] if args and isinstance(args[0], type) else str


def _preset_defaults(config_cls, argv, presets: Mapping, parser: argparse.ArgumentParser) -> dict:
    """The chosen preset's values for the fields ``config_cls`` has."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    if "preset" not in fields:
        raise TypeError(f"{config_cls.__name__} needs a `preset` field to take presets")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default=fields["preset"].default)
    chosen = pre.parse_known_args(argv)[0].preset
    if not chosen:
        return {}
    if chosen not in presets:
        parser.error(f"argument --preset: unknown preset {chosen!r}: choose one of {tuple(presets)}")
    values = presets[chosen]
    values = values.fields() if hasattr(values, "fields") else dict(values)
    return {k: v for k, v in values.items() if k in fields}


def parse_config(config_cls, argv=None, *, description: str | None = None, presets: Mapping | None = None):
    """``config_cls(**flags)``: one ``--field-name`` flag per field, defaults from the class
    (``--flag/--no-flag`` for booleans), so ``--help`` lists every option with its default.

    With ``presets`` (name -> object with ``fields()`` or a mapping of field values, e.g.
    ``ringsplash.model.presets.PRESETS``) ``config_cls`` must have a ``preset`` field:
    ``--preset NAME`` makes that preset's values the defaults of the fields ``config_cls`` has
    (others are ignored) and explicit flags still override them; an empty name = no preset.
    """
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = _preset_defaults(config_cls, argv, presets, parser) if presets is not None else {}
    for field in dataclasses.fields(config_cls):
        flag = "--" + field.name.replace("_", "-")
        default = defaults.get(field.name, field.default)
        if isinstance(field.default, bool):
            parser.add_argument(flag, dest=field.name, default=default, action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(flag, dest=field.name, type=_flag_type(field), default=default,
                                help=f"(default: {default!r})")
    return config_cls(**vars(parser.parse_args(argv)))
