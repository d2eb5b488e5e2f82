"""LoRA adapters (PEFT) in a checkpoint: recognised by their names, then exported as a PEFT
adapter or folded into the base weights.

- :mod:`.layout`: the names and shapes of an adapter (:class:`~.layout.Layout`), its
  ``adapter_config.json`` and where trainers record it;
- :mod:`.fold`: the folded weight ``W + scale * B @ A`` as derived tensors, and the numerics
  that keep it exact (fused multiply-add where it cannot round twice);
- :mod:`.plan`: the checks shared by merge and verify, the plans (fold or export), a merged
  model that is still its base, and the wiring into ``merge()`` and ``verify()``;
- :mod:`.report`: the report sections (``lora`` in inspect, merge and verify).


A PEFT model's state dict names every tensor under ``base_model.model.``: a target module's
weight as ``<module>.base_layer.weight`` beside ``<module>.lora_A.<adapter>.weight`` (``[r,
in]``) and ``<module>.lora_B.<adapter>.weight`` (``[out, r]``); an embedding's as
``lora_embedding_A/B.<adapter>`` (no ``.weight``); a ``modules_to_save`` module twice, as
``<module>.original_module.*`` and ``<module>.modules_to_save.<adapter>.*``; DoRA adds
``lora_magnitude_vector``. ``PeftModel.save_pretrained`` writes the adapter alone, without
the adapter name (``lora_A.weight``) and with a trained copy under its base name.

Planning here is pure: it turns names, shapes and ``adapter_config.json`` into merge sources
(:class:`~ckpttool.core.transforms.derive.Derived` for a folded weight). Nothing is guessed:
rank comes from the shapes and must agree with the config; alpha comes from the config or nowhere.
"""
