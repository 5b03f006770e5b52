"""The round protocol with no Flower and no files: what the server sends, what a client
answers, how a reply is validated, and building both sides' specs from a run config."""
