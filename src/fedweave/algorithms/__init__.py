"""Algorithm families; importing this package registers every algorithm by name."""
