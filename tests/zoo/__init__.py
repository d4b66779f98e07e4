"""Third-party models (transformers, diffusers) from tiny configs built in code."""
