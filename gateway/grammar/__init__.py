"""The structured-output check before a request is sent: the compiler child processes, the fair
queue for them, and the one owner that starts them and asks them.

Nothing is imported here.
"""
