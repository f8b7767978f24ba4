"""The object store's credential variables, declared once: the OBS SDK's own names (esdk-obs-python's ENV
provider). They are read from the environment by storage/obs/client.py alone, never through the JobSpec (it is printed
by `--print-config` and logged), and redact.py treats the names as names, never as values to mask."""

ACCESS_KEY_VARIABLE = "OBS_ACCESS_KEY_ID"
SECRET_KEY_VARIABLE = "OBS_SECRET_ACCESS_KEY"
TOKEN_VARIABLE = "OBS_SECURITY_TOKEN"
CREDENTIAL_VARIABLES = (ACCESS_KEY_VARIABLE, SECRET_KEY_VARIABLE, TOKEN_VARIABLE)
