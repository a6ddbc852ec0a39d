"""What the commands do: check, compile, verify, and the options they take."""
