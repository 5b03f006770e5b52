"""What the key table (:mod:`qlsd_flwr.keys`) generates: ``[tool.flwr.app.config]`` for ``pyproject.toml``,
``qlsd-flwr config``'s text, docs/CONFIGURATION.md's table."""

from __future__ import annotations

from typing import Any

from qlsd_flwr.keys import DEFAULTS, KEYS, RUN, SAMPLE, SAMPLER


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def pyproject_block(values: dict | None = None) -> str:
    """``[tool.flwr.app.config]`` with every key (``values`` over the defaults)."""
    vals = {**DEFAULTS, **(values or {})}
    return "[tool.flwr.app.config]\n" + "".join(f"{k.name} = {_toml(vals[k.name])}\n" for k in KEYS)


def help_text(width: int = 100) -> str:
    """Every key with its default, symbol, allowed values and meaning, grouped (plain text)."""
    import textwrap

    out = []
    for group in (SAMPLE, SAMPLER, RUN):
        out.append(f"{group}:")
        for k in (k for k in KEYS if k.group == group):
            sym = f" ({k.symbol})" if k.symbol else ""
            head = f"  {k.name} = {_toml(k.default)}{sym}"
            body = f"{k.doc}; allowed: {k.allowed()}" if k.kind not in ("text",) else k.doc
            out.append(head)
            out.extend(textwrap.wrap(body, width, initial_indent="      ", subsequent_indent="      ",
                                     break_on_hyphens=False))  # a choice such as qlsd-sharp stays whole
    return "\n".join(out) + "\n"


def markdown_table() -> str:
    """docs/CONFIGURATION.md's key table."""
    def cell(text: str) -> str:  # '<module>' would be read as an HTML tag, '|' as a column
        return text.replace("|", "/").replace("<", "&lt;").replace(">", "&gt;")

    rows = ["| key | meaning | symbol | allowed | default |", "|---|---|---|---|---|"]
    for k in KEYS:
        allowed = k.allowed() if k.kind != "text" else "text"
        rows.append(f"| `{k.name}` | {cell(k.doc)} | {k.symbol} | {cell(allowed)} | `{_toml(k.default)}` |")
    return "\n".join(rows) + "\n"
