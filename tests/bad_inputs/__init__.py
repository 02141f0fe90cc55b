"""The bad-input corpus: inputs a careful new user might give, grouped by category, each asserting
the clear error (naming the user's thing and the fix), the warning, or the right numbers."""
