"""Activation memory as autograd sees it: the bytes of the tensors saved for backward
(``test_recompute.py`` and ``test_sequence_parallel.py`` count them)."""


class SavedBytes:
    """Live bytes of the tensors autograd holds for backward, and their peak.

    Installed as ``torch.autograd.graph.saved_tensors_hooks``: every tensor an op (or
    ``CheckpointFunction``) saves passes through :meth:`pack`; a storage counts once
    however often it is saved, until the last saved reference to it is released (after
    its node ran in backward). Parameters (and views of them, e.g. transposed weights)
    are not activations and are skipped. The count is exact and deterministic: it does
    not depend on the allocator or on what else runs on the machine.
    """

    class _Held:
        def __init__(self, owner: "SavedBytes", tensor, key: int) -> None:
            self.owner, self.tensor, self.key = owner, tensor, key

        def __del__(self) -> None:
            self.owner._release(self.key)

    def __init__(self, params) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict = {}  # storage pointer -> [saved references, bytes]
        self.live = self.peak = 0

    def pack(self, tensor):
        key = tensor.untyped_storage().data_ptr()
        if key in self.skip:
            return tensor
        ref = self.refs.setdefault(key, [0, tensor.untyped_storage().nbytes()])
        if ref[0] == 0:
            self.live += ref[1]
            self.peak = max(self.peak, self.live)
        ref[0] += 1
        return SavedBytes._Held(self, tensor, key)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, SavedBytes._Held) else held

    def _release(self, key: int) -> None:
        ref = self.refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self.refs[key]
