"""A draft plan made to serve beside a target: the decided modules' tensors replaced by what
their schemes take (convert/schemes/), each made from the native tensors' source bytes.

Pure: a plan in, a plan out; no byte is read. An output that keeps its input's bytes (the
"copy" transform: a rename, or a dtype relabelled at the same size) is planned as those
bytes; an output computed from its inputs carries its transform (convert/transforms.py),
checked here against what the transform makes of those inputs, for the executor."""

from __future__ import annotations

import dataclasses

from dsv4.convert.errors import PlanError
from dsv4.convert.plan import Plan
from dsv4.convert.planned import PlannedTensor, Transform
from dsv4.convert.schemes.base import Decision, Output, ServePlan, module_of
from dsv4.convert.transforms import TransformInputError, planned_spec, same_size


def _refuse(o: Output, d: Decision, why: str) -> PlanError:
    return PlanError(
        f"{o.name}: {d.module} built {d.scheme.name} takes it by {o.transform} of {', '.join(o.inputs)}, which {why}",
        kind="layout_mismatch",
        tensor=o.name,
    )


def _planned(o: Output, d: Decision, by_name: dict[str, PlannedTensor], source_block: tuple[int, int]) -> PlannedTensor:
    missing = [name for name in o.inputs if name not in by_name]
    if missing or not o.inputs:
        raise _refuse(o, d, f"reads {missing[0] if missing else 'nothing'}, no tensor of the native draft")
    inputs = tuple(by_name[name] for name in o.inputs)
    try:
        made = planned_spec(o.transform, [(t.dtype, t.shape) for t in inputs], dict(o.args), source_block)
    except TransformInputError as exc:
        raise _refuse(o, d, str(exc)) from None
    want = (o.dtype, o.shape)
    if o.transform == "copy":
        if not same_size(made, want):
            raise _refuse(o, d, f"is {made[0]}{list(made[1])}, not relabelled as {o.dtype}{list(o.shape)}")
        return PlannedTensor(o.name, o.dtype, o.shape, inputs[0].pieces, inputs[0].op, inputs[0].rule)
    if made != want:
        raise _refuse(o, d, f"makes {made[0]}{list(made[1])}, not {o.dtype}{list(o.shape)}")
    transform = Transform(o.transform, o.args, inputs, o.exact, source_block)
    pieces = tuple(p for t in inputs for p in t.pieces)
    return PlannedTensor(o.name, o.dtype, o.shape, pieces, o.transform, inputs[0].rule, transform)


def apply_route(plan: Plan, serve: ServePlan) -> Plan:
    """`plan` (a draft plan in native names) with every decided module's tensors replaced by
    its scheme's outputs; every other tensor (norms, hyper-connections) as it was."""
    by_name = {t.name: t for t in plan.tensors}
    native = {t.name: (t.dtype, t.shape) for t in plan.tensors}
    decided = {part for d in serve.decisions for part in d.parts}
    out = [t for t in plan.tensors if module_of(t.name) not in decided]
    block = plan.model_config.weight_block_size
    names = {t.name for t in out}
    for d in serve.decisions:
        for o in d.outputs(native):
            if o.name in names:
                raise PlanError(f"{o.name}: produced twice (by {d.module})", kind="duplicate_target", tensor=o.name)
            names.add(o.name)
            out.append(_planned(o, d, by_name, block))
    ordered = tuple(sorted(out, key=lambda t: (t.pieces[0].file, t.pieces[0].start)))
    return dataclasses.replace(plan, tensors=ordered)
