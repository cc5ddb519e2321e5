"""Plain-torch reference kernels: the specification every fast kernel is tested against."""
