"""What every callback shares: which weights to act on, optimizer state, distributed helpers,
argument checks and figures. No Lightning import at module level."""
