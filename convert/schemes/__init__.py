"""The quantisation schemes of a serving target: given the target's `quantization_config` and
`num_hidden_layers`, which scheme the runtime builds for each draft module, and so which
tensors the draft must hold (names, dtypes, shapes).

Why here, in convert/ and not in mapping/: today's two entries are pure, but the entries that
come next (compressed-tensors with its formats, ModelOpt) match module names with
compressed-tensors' own functions and pack with its compressors, an optional library that
only convert/ imports (lazily), and their refusals are the converter's and `check`'s errors.

The rooms:
  base.py           the draft's modules as the runtime names them (`LayerMap`, from a plan and
                    the cached quantisation layers: no model build), a `Scheme` (what one
                    module is built as, and the tensors its native parts then hold) and the
                    schemes the entries share
  deepseek_fp8.py   DeepSeek's own fp8 (`quant_method: fp8`): the draft served as it is
  compressed_tensors.py  a compressed-tensors target: the routes (overlay, bf16, match-target)
                    and a DSpark draft's own config
  ct_config.py      the target's compressed-tensors config read strictly, each group's scheme
                    as vLLM dispatches it
  ct_match.py       which group vLLM gives each draft module, per platform (vLLM's own rules)
  ct_schemes.py     the tensors each compressed-tensors scheme makes from the native draft
  bounded_re.py     the target's `re:` entries matched in a child process, in bounded time
  modelopt.py       a ModelOpt target: exclude_modules, the bf16 route
  unquantised.py    no quantization_config: no draft layer quantised (bf16)
  registry.py       one entry per target `quant_method`; `decide`, `serve_plan`,
                    `draft_tensors` and the serve check; an unknown method is refused naming
                    the field

A new target method is one module with a `TargetMethod` (its `serve` giving its routes) and
one line in registry.py.
"""
