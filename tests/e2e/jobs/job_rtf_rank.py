"""An RTF rank across nodes (test_job_launchers.py): records its start, its attempt and the device IP its node's
converted rank table gives it in MARKS/start-<attempt>-<rank>. In attempt 1, rank FAIL_RANK exits 1 once the test
has written MARKS/fail (after rewriting the rank tables); the others wait to be stopped.
"""

import json
import os
import time

marks, attempt, rank = os.environ["MARKS"], os.environ["MA_PROC_START_CNT"], os.environ["RANK_ID"]
with open(os.environ["RANK_TABLE_FILE"]) as handle:
    table = json.load(handle)
device_ip = next(device["device_ip"] for server in table["server_list"] for device in server["device"]
                 if device["rank_id"] == rank)
record = os.path.join(marks, f"start-{attempt}-{rank}")
with open(record + ".tmp", "w") as handle:
    handle.write(device_ip)
os.replace(record + ".tmp", record)
if attempt == "1":
    if os.environ.get("FAIL_RANK") == rank:
        while not os.path.exists(os.path.join(marks, "fail")):
            time.sleep(0.05)
        os._exit(1)
    time.sleep(300)
