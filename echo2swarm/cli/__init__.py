"""Command-line interface. Commands parse and validate, then import the heavy code lazily."""
