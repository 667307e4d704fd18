"""The tool-use collapse experiment on ``testbed:tools`` (README.md): does RL stop calling the tool where it is
needed, and which arm keeps it."""
