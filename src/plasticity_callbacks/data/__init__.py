"""Tokenizer and data modules. Nothing here downloads anything."""
from .corpus import stdlib_dir, stdlib_files, split_files, top_level_package
from .datamodule import CodeCorpusDataModule, PackedWindows, pack_files
from .sft import InstructionPair, MultiValidationDataModule, SFTDataModule, function_pairs, parse_chat, render_chat
from .tokenizer import IGNORE_INDEX, SPECIAL_TOKENS, ByteTokenizer

__all__ = [
    "ByteTokenizer", "IGNORE_INDEX", "SPECIAL_TOKENS", "CodeCorpusDataModule", "PackedWindows", "pack_files",
    "stdlib_dir", "stdlib_files", "split_files", "top_level_package",
    "SFTDataModule", "MultiValidationDataModule", "InstructionPair", "function_pairs", "render_chat", "parse_chat",
]
