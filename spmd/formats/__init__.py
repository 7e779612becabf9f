"""Files and storage: Orbax checkpoints (checkpoint, checksum), safetensors, Hugging Face
directories (hf: config.json, sharded weights, tokenizer files) read and written one layer
at a time, and PEFT adapter directories (peft).
"""
