"""Platform compatibility pieces (today: running sglang's CPU engine without an sgl-kernel build)."""
