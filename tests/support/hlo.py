"""Reading compiled HLO text: computations, kernel calls and the windows of async collective-permutes."""

import re

_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_INSTR = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = .*?\b([a-z][\w\-]*)\(")
_CALLS = re.compile(r"(?:calls|body|condition|to_apply|branch_computations|true_computation|false_computation)="
                    r"\{?([%\w.\-, ]+)\}?")
_KERNEL = re.compile(r'^\s+(?:ROOT )?%splash_\w+(?:\.\d+)? = .*\bcustom-call\(.*custom_call_target="tpu_custom_call"')


def parse_hlo(text: str):
    """{computation: [(name, opcode, line)]} in scheduled order."""
    comps, current = {}, None
    for line in text.splitlines():
        if m := _COMP.match(line):
            current = comps.setdefault(m.group(1), [])
        elif current is not None and (m := _INSTR.match(line)):
            current.append((m.group(1), m.group(2), line))
    return comps


def holds_kernel(comps, line: str, seen=None) -> bool:
    """Whether an instruction is a Splash Mosaic kernel call (a ``tpu_custom_call`` named
    ``splash_*``) or calls a computation holding one (a loop body, a fusion, a conditional with
    a kernel in some branch; a conditional whose branches hold none does not count)."""
    if _KERNEL.match(line):
        return True
    seen = set() if seen is None else seen
    for group in _CALLS.findall(line):
        for callee in (c.strip().lstrip("%") for c in group.split(",")):
            if callee in comps and callee not in seen:
                seen.add(callee)
                if any(holds_kernel(comps, l, seen) for _, _, l in comps[callee]):
                    return True
    return False


def overlap_violations(text: str) -> list[str]:
    """Every way the schedule fails to hide a ring transfer behind a Splash kernel: no
    collective permute at all, a synchronous ``collective-permute``, a ``-start`` without its
    ``-done`` in the same computation, or a start/done window with no kernel scheduled inside."""
    comps = parse_hlo(text)
    problems, starts = [], 0
    for comp, instrs in comps.items():
        for i, (name, op, _) in enumerate(instrs):
            if op == "collective-permute":
                problems.append(f"synchronous collective-permute %{name} in %{comp}")
            if op != "collective-permute-start":
                continue
            starts += 1
            done = [j for j, (_, op2, l) in enumerate(instrs)
                    if op2 == "collective-permute-done" and re.search(rf"\(%{re.escape(name)}\)", l)]
            if not done:
                problems.append(f"%{name} in %{comp} has no collective-permute-done in the same computation")
            elif not any(holds_kernel(comps, l) for _, _, l in instrs[i + 1 : done[0]]):
                problems.append(f"no Splash kernel between %{name} and %{instrs[done[0]][0]} in %{comp}")
    if not starts:
        problems.append("no collective-permute-start: the ring's transfers are missing")
    return problems


def permute_windows(text: str):
    """For every collective-permute-start: (computation, start, done, kernels scheduled between);
    used where some windows may legitimately overlap other collectives instead (USP)."""
    comps = parse_hlo(text)
    windows = []
    for comp, instrs in comps.items():
        for i, (name, op, _) in enumerate(instrs):
            if op != "collective-permute-start":
                continue
            done = next(j for j, (_, op2, l) in enumerate(instrs)
                        if op2 == "collective-permute-done" and re.search(rf"\(%{re.escape(name)}\)", l))
            between = [n for n, _, l in instrs[i + 1 : done] if holds_kernel(comps, l)]
            windows.append((comp, name, instrs[done][0], between))
    return windows


def count_permute_starts(text: str) -> int:
    return sum(op == "collective-permute-start" for instrs in parse_hlo(text).values() for _, op, _ in instrs)


# crafted schedules: the check must reject each bad one and accept the good ones
