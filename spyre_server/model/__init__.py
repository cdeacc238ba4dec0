"""The model layer: loading an fms model, the KV cache tensors, and the runner that executes the
scheduler's steps on them (DESIGN §2). It holds no scheduling state."""
