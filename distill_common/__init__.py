"""Code both programs share: the generated contract, tensor wire format, session groups."""
