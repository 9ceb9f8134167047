"""Float64 evaluations of the upstream maths (numpy), written independently of the C
reference: the accuracy oracle of the tests and of `python -m mamba check`."""
