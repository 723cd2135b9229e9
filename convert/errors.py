"""The error families of the converter, the hub and batch jobs, and `check` (their kinds'
exit codes: convert/exit_codes.py). The model layer's (reading checkpoint files, loading
the model) and the table's are in dsv4.model.errors and dsv4.mapping.errors."""

from __future__ import annotations

from dsv4.model.errors import DSV4Error


class PlanError(DSV4Error):
    """The checkpoint cannot be converted by the table as it stands, or changed under the
    conversion."""

    KINDS = (
        "plan_failed",  # a tensor consumed by more than one rule
        "uncovered_key",  # a source key no rule covers
        "missing_source",
        "layout_mismatch",  # a shape or dtype disagrees with the config or the model
        "duplicate_target",
        "source_changed",  # a source file changed between planning and publishing: nothing is published
        "quant_carry",  # the quantization_config cannot be carried to the draft's layer names unchanged
        # a served draft's tensor its scheme takes exact cannot be (an FP4 block whose scales span
        # more than FP8 e4m3 holds): refused while computing it, nothing is published
        "inexact_transform",
        # a lossy served draft's agreement run gave logits that are not finite: nothing is published
        "non_finite_agreement",
    )


class OutputError(DSV4Error):
    """OUT cannot be (or was not) written safely."""

    KINDS = (
        "output_exists",
        "write_failed",  # an OSError writing or publishing OUT: path, OS reason, what became of OUT
        "output_is_source",  # after resolving symlinks
        "output_in_source",
        "source_in_output",  # or inside one of OUT's hidden working directories
        "output_parent",  # OUT's parent is not a directory, or cannot be created
        "output_locked",  # another run holds OUT's lock (pid, host named)
        "overwrite_refused",  # --overwrite given, but OUT is not a previous output of this tool
    )


class HubError(DSV4Error):
    """The hub refused or failed a request, or a batch job (its manifest, a repository of
    it) failed."""

    KINDS = (
        "hub_request_failed",
        "repo_not_found",
        "revision_not_found",
        "download_failed",  # a planned byte range not fetched whole (wrong length, retries exhausted)
        "bad_manifest",
        "push_failed",
        "batch_failed",  # at least one repository of a batch failed; the others were still processed
    )


class CheckError(DSV4Error):
    """A check of `convert-dsv4 check` failed; the kind names the check, so CI can tell the
    failures apart."""

    KINDS = (
        "index_check",  # index and shard headers disagree: names, missing or stray shards, offsets, gaps
        "unreadable_tensor",
        "size_check",  # index total_size or conversion.json sizes/files disagree with the shards
        "checksum_mismatch",
        "config_check",  # config.json lacks the conversion record or disagrees with the tensors
        "missing_tensors",
        "unexpected_tensors",
        "tensor_shape",
        "tensor_dtype",
        "quant_scheme",  # a linear resolves to no scheme, or to several, and is not ignored
        "empty_quant_name",  # a linear with an empty quantisation layer name (vLLM issue #44817)
        "smoke_failed",  # the strict load or the few-token forward failed
        "native_parity",  # the converted draft disagrees with the reference run on the native checkpoint
        # --serve-with: the target model would build the draft's layers differently (vLLM 0.33.0
        # builds an MTP or DSpark draft from the target's config and quantisation; NOTES.md,
        # "Serving a draft"); `field` is the first config field that differs
        "serve_mismatch",
    )
