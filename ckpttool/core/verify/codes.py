"""Every problem code ``verify`` (and the checks ``merge`` shares with it) can report: the one
list that docs/verify.md's table is generated from.

The codes themselves are written where each check finds its problem (formats, structure, ties,
dtype policy, LoRA...), next to the message; this table gives each its severity and one line
of meaning. A test walks the source for every code a check can emit and fails when one is
missing here or listed here but emitted nowhere, so the documentation cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Code:
    """One problem code, as the documentation describes it."""

    code: str  # as in Problem.code and --json's "code"
    severity: str  # "error", "warning", "info", or "warning/error" where it depends (see meaning)
    check: str  # which check reports it (a row group of the table)
    meaning: str  # one line: what was found


CODES: tuple[Code, ...] = (
    # structure: read from metadata and file sizes, no data
    Code("missing-file", "error", "structure",
         "a data file the metadata or index names does not exist"),
    Code("truncated-file", "error", "structure",
         "a data file ends before a byte range the metadata places in it"),
    Code("stray-file", "warning", "structure",
         "a data file (`.distcp`) that the metadata does not reference"),
    Code("chunk-overlap", "error", "structure", "two chunks of a tensor cover the same elements"),
    Code("chunk-gap", "error", "structure", "part of a tensor is in no chunk"),
    Code("chunk-bounds", "error", "structure", "a chunk reaches outside its tensor's shape"),
    Code("tensors-unplaced", "error", "structure",
         "distributed tensors pickled whole by one rank (`flatten_state_dict=False`): only one "
         "rank's shards are there"),
    Code("header-corrupt", "error", "structure",
         "a safetensors header, or a `.bin` shard's, that cannot be read"),
    Code("bad-offsets", "error", "structure",
         "a safetensors tensor whose byte span does not fit its dtype and shape, or overlaps "
         "another"),
    Code("duplicate-tensor", "error", "structure",
         "a tensor stored in several shards (a loader keeps one at random)"),
    Code("index-missing", "error", "structure",
         "shards of a set (`-of-N` names) without their index: a save or publish that did "
         "not finish (the index is written last), which loaders refuse"),
    Code("index-missing-tensor", "error", "structure",
         "the index names a tensor its shard does not hold"),
    Code("index-extra-tensor", "error", "structure", "a shard holds a tensor the index omits"),
    Code("index-duplicate", "error", "structure", "the index lists a tensor twice"),
    Code("index-total-size", "warning", "structure",
         "the index's `total_size` differs from the shards' tensor bytes"),
    # content: one streaming pass over the data
    Code("record-corrupt", "error", "content",
         "a record does not decode as the metadata promises (or does not decompress)"),
    Code("crc-mismatch", "error", "content",
         "a record's bytes differ from the CRC-32 `torch.save` stored for them"),
    Code("copy-differs", "error", "content",
         "copies of one chunk that several ranks stored (`use_collectives=False`) differ"),
    Code("read-error", "error", "content", "a data file could not be read (I/O error)"),
    Code("nan", "warning", "content", "a floating tensor holds NaN values"),
    Code("inf", "warning", "content", "a floating tensor holds infinite values"),
    Code("all-zero", "warning", "content", "a tensor is all zeros"),
    # non-tensor entries
    Code("code-in-checkpoint", "error", "non-tensor entries",
         "a pickled entry asks for a function that runs code or reaches the system when "
         "unpickled (never executed)"),
    Code("object-not-read", "warning", "non-tensor entries",
         "a pickled entry that weights-only reading cannot rebuild (not executed, not read)"),
    # names
    Code("names-not-hf", "warning", "names",
         "the names are a training framework's own (torchtitan, torchtune, Megatron) or do not "
         "fit config.json's architecture; the message names the `--names` map"),
    # --loader: the output held against the model config.json names (core.contract)
    Code("contract-missing", "error", "contract (--loader)",
         "a tensor the config's model class expects is not there (it would be left randomly "
         "initialised)"),
    Code("contract-shape", "error", "contract (--loader)",
         "a tensor's shape differs from the one the config's model class expects"),
    Code("contract-extra", "warning", "contract (--loader)",
         "tensors the config's model class does not take (loading drops them)"),
    Code("contract-unchecked", "warning", "contract (--loader)",
         "the contract could not be checked (the loader cannot build the config's model "
         "here); the message says why"),
    # file digests a writer recorded
    Code("integrity-mismatch", "error", "integrity.json (Megatron)",
         "a file's SHA-256 differs from the one `integrity.json` records"),
    Code("integrity-missing", "error", "integrity.json (Megatron)",
         "a file `integrity.json` lists cannot be read"),
    Code("integrity-outside", "error", "integrity.json (Megatron)",
         "`integrity.json` names a file outside the checkpoint (not read)"),
    Code("integrity-unreadable", "error", "integrity.json (Megatron)",
         "`integrity.json` is not readable JSON"),
    Code("integrity-unknown", "warning", "integrity.json (Megatron)",
         "`integrity.json` holds no SHA-256 per file (not checked)"),
    Code("receipt-mismatch", "error", "merge receipts",
         "an output file's size differs from what the receipt of `merge --all` recorded"),
    # ties
    Code("tie-broken", "error", "tied embeddings",
         "the config ties the embeddings but `lm_head` differs from the input embedding"),
    Code("tie-missing", "error", "tied embeddings",
         "the config unties the embeddings but there is no `lm_head` (the trained output "
         "embedding is lost)"),
    Code("tie-ok", "info", "tied embeddings", "the tied pair is identical or stored once"),
    Code("tie-candidate", "info", "tied embeddings",
         "without a config: a pair of tensors that look tied"),
    # dtypes
    Code("dtype-upcast", "error", "dtypes",
         "a floating tensor wider than `--expect-dtype` (mixed precision's fp32 copy?)"),
    Code("dtype-mismatch", "error", "dtypes", "a floating tensor of another dtype than expected"),
    Code("fsdp-prefix", "warning/error", "dtypes",
         "`architectures` names an `FSDP...` class (a warning for a training checkpoint, "
         "an error for a model to serve)"),
    Code("float8-tensors", "info", "dtypes", "float8 tensors, kept as stored"),
    Code("int-tensors", "info", "dtypes", "integer tensors, kept as stored"),
    Code("bool-tensors", "info", "dtypes", "bool tensors, kept as stored"),
    Code("dtype-differs-from-config", "info", "dtypes",
         "the stored floating dtype is not the config's `torch_dtype`"),
    Code("dtype-unknown", "info", "dtypes",
         "`--expect-dtype auto` without a config dtype: nothing to compare against"),
    # LoRA
    Code("lora-unsupported", "error", "LoRA adapters",
         "an adapter layout ckpttool does not handle (several adapters...)"),
    Code("lora-no-alpha", "warning", "LoRA adapters",
         "no `adapter_config.json` (nor verl's `lora_train_meta.json`), so alpha (the scale) is "
         "unknown: folding needs `--adapter-config`"),
    Code("lora-config", "error", "LoRA adapters", "`adapter_config.json` cannot be read"),
    Code("lora-dora", "info", "LoRA adapters",
         "a DoRA adapter: intact; not folded yet (exit 4), written alone by --lora adapter"),
    Code("lora-unpaired", "error", "LoRA adapters", "a `lora_A` without its `lora_B`, or back"),
    Code("lora-shape", "error", "LoRA adapters",
         "`lora_A` and `lora_B` do not multiply, or not into the base weight's shape"),
    Code("lora-rank", "error", "LoRA adapters", "the adapter's rank is not the config's `r`"),
    Code("lora-no-base", "error", "LoRA adapters",
         "no base weight (or bias) for the adapter to apply to"),
    Code("lora-untrained", "warning", "LoRA adapters",
         "every `lora_B` is zero: folding changes nothing"),
    # quantized weights (core.quantization)
    Code("quant-config", "error", "quantization",
         "`quantization_config` disagrees with the stored tensors: a scale's shape against "
         "the block size, a scale's or weight's dtype, a module it leaves unquantized stored "
         "quantized, or no tensor stored the way it says"),
    Code("quant-scale-missing", "error", "quantization",
         "a float8 weight without the scale its values need"),
    Code("quant-fused-split", "warning", "quantization",
         "a layer vLLM and SGLang load as one (q/k/v, gate/up, one layer's experts) is stored "
         "partly quantized: they refuse to load it (transformers loads it)"),
    Code("quant-no-config", "warning", "quantization",
         "quantized weights with scales but no `quantization_config`: loaders read them as "
         "plain weights"),
    # --against
    Code("unchanged-from-base", "warning", "--against",
         "every LoRA target weight of a merged model is bit-identical to OTHER: the adapter "
         "was never folded in (or never trained)"),
    Code("against-mapped", "info", "--against",
         "PATH's names are no model's: OTHER is held to what merge makes of it, through the "
         "same LoRA fold or name map (`--names`, Megatron's implied one)"),
    Code("against-unmapped", "error", "--against",
         "PATH's tensors cannot be made as merge makes them (no alpha for a LoRA fold: pass "
         "`--lora-alpha`; a name map that does not fit), so OTHER is not compared"),
    Code("missing-tensor", "error", "--against", "a tensor of PATH is not in OTHER"),
    Code("extra-tensor", "error", "--against", "OTHER holds a tensor PATH does not"),
    Code("shape-differs", "error", "--against", "the same tensor has another shape"),
    Code("dtype-differs", "error", "--against",
         "the same tensor has another dtype (see `--allow-cast`)"),
    Code("data-differs", "error", "--against", "the same tensor has other bytes"),
    Code("quant-scale-cast", "error", "--against",
         "a scale of a quantized weight has another dtype: an error with `--allow-cast` too"),
    Code("tie-deduplicated", "info", "--against",
         "OTHER stores a tied copy once, as merge writes it"),
    # --base
    Code("identical-to-base", "warning", "--base",
         "every tensor of PATH is bit-identical to BASE: what made it changed nothing"),
    Code("differs-from-base", "info", "--base",
         "how many tensors of PATH differ from BASE (`ckpttool diff BASE PATH` lists them)"),
    # manifests
    Code("manifest-mismatch", "error", "manifests",
         "a tensor's SHA-256 differs from the manifest's"),
    Code("manifest-missing", "error", "manifests", "a tensor of the manifest is not in PATH"),
    Code("manifest-extra", "error", "manifests", "PATH holds a tensor the manifest lacks"),
    Code("manifest-incomplete", "error", "manifests",
         "the manifest was not written: some tensors could not be read"),
)
