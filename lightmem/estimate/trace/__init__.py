"""The fake step as it runs: one dispatch mode recording memory and priced ops, the blocks it
runs through, the user's code run on a stand-in, the values it cannot see, optimizer state."""
