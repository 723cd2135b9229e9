"""A draft plan made to serve beside a target: the decided modules' tensors replaced by what
their schemes take (convert/schemes/), each made from the native tensors' source bytes.

Pure: a plan in, a plan out; no byte is read. An output that keeps its input's bytes (the
"copy" transform: a rename, or a dtype relabelled at the same size) is planned as those
bytes; an output computed from its inputs carries its transform for the executor."""

from __future__ import annotations

import dataclasses

from dsv4.convert.errors import PlanError
from dsv4.convert.plan import Plan, PlannedTensor
from dsv4.convert.schemes.base import Output, ServePlan, module_of
from dsv4.model.dtypes import nbytes


def _copied(o: Output, source: PlannedTensor) -> PlannedTensor:
    if nbytes(o.dtype, o.shape) != source.nbytes:
        raise PlanError(
            f"{o.name}: a copy of {source.name} ({source.dtype}{list(source.shape)}) cannot be "
            f"{o.dtype}{list(o.shape)}: the sizes differ",
            kind="layout_mismatch",
            tensor=o.name,
        )
    return PlannedTensor(o.name, o.dtype, o.shape, source.pieces, source.op, source.rule)


def apply_route(plan: Plan, serve: ServePlan) -> Plan:
    """`plan` (a draft plan in native names) with every decided module's tensors replaced by
    its scheme's outputs; every other tensor (norms, hyper-connections) as it was."""
    by_name = {t.name: t for t in plan.tensors}
    native = {t.name: (t.dtype, t.shape) for t in plan.tensors}
    decided = {part for d in serve.decisions for part in d.parts}
    out = [t for t in plan.tensors if module_of(t.name) not in decided]
    for d in serve.decisions:
        for o in d.outputs(native):
            if o.transform != "copy":
                raise PlanError(
                    f"{o.name}: the {o.transform} transform ({d.module} built {d.scheme.name}) is not in this build",
                    kind="quant_carry",
                    tensor=o.name,
                )
            out.append(_copied(o, by_name[o.inputs[0]]))
    ordered = tuple(sorted(out, key=lambda t: (t.pieces[0].file, t.pieces[0].start)))
    return dataclasses.replace(plan, tensors=ordered)
