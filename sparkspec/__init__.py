"""sparkspec: DeepSeek-V4 inference with lossless DSpark / MTP speculative decoding."""

__version__ = "0.1.0"
