"""LoRA adapters per request: the engine's room for them.

spec (read and check a PEFT folder), targets (the model's linear layers), store (host copies, LRU),
slots + layer (the device slots and the wrapped linears: one gathered pass for every adapter of a
step), triton_kernel (the gathered product on CUDA), requests (LLM's lora_request -> request
extras), setup (building it all for an engine). Which adapter holds which slot is the scheduler's
policy: core/adapter_slots. The room sits below runner/ and above staging/ and core/.
"""
