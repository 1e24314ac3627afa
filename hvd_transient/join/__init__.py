"""A new VM's way into a running ring without stalling it: a standby worker started at boot
(``supervisor``, ``standby``, ``warmup``) publishes itself ready, and the job's command on that host
(``launcher``) hands it the job over a unix socket (``wire``, ``signals``); ``worker`` is the
command line behind ``python -m hvd_transient.worker``, ``user_dirs`` the user's private directories.
"""
