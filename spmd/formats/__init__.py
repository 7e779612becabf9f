"""Files and storage: Orbax checkpoints (checkpoint, checksum), safetensors, and Hugging Face
directories (hf: config.json, sharded weights, tokenizer files) read and written one layer
at a time.
"""
