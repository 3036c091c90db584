"""Checkpoints on disk: one reader per file format (safetensors, GGUF, FP8 block-scaled
safetensors) that know nothing of each other, ``dispatch.open_checkpoint`` that picks
one, the expert naming, the safetensors writer, the conversion of GGUF / FP8 experts
while loading, quantization and generated checkpoints. Imports placement and below."""
