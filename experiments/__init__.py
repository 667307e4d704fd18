"""Research experiments built on meshrl, kept out of the installed package (each directory has a README)."""
