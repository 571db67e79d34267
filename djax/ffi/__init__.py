"""C++ XLA FFI handlers (csrc/), built with the system compiler on first use and registered with JAX."""
