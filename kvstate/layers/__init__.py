"""nn.Modules of hybrid decoders: norms, rotary, attention, MLA, Gated DeltaNet, KDA, Mamba-2, Mamba-1, MLP, MoE.

Layers take packed token tensors [T, hidden] (T = sum of the batch's new tokens), the step's
`Batch` metadata and their own slice of the cache pools, passed explicitly.
"""
