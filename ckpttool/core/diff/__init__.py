"""``diff`` and deltas: what changed between two checkpoints of any format, tensor by tensor
(:mod:`.plan` pairs them, :mod:`.values` measures a change, :mod:`.operation` streams both),
a delta that rebuilds the second from the first (:mod:`.delta`) and ``apply`` (:mod:`.apply`).
"""
