"""Hot kernels: pure-jnp references (the spec) and fast Triton/TileLang/FFI versions beside them."""
