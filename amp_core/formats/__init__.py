"""Block-scaled formats (MXFP8, NVFP4, blockwise FP8): one quantise/dequantise per format (`quantize`), the emulated
Linear that trains with them (`linear`), the recipe options that race them (`recipes`) and their numerics per layer
(`numerics`).

May import: torch and the utilities at amp_core's top (imports, torch_private) only: precision/ reads the
block-scaled options from here.
"""
