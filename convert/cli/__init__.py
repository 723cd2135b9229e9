"""The command line: main.py (the group, `targets`, main()), the options every command shares
(common.py), and the commands by concern (convert.py, model.py, batch.py)."""
