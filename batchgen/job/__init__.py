"""The job file: its schema (spec, with one section per key of the file), the YAML it is parsed
from with each key's line and the `--set` overrides, and error messages that point at the line; the
LoRA adapters it names, read and checked (adapters, with the keys' own rules in lora_keys)."""
