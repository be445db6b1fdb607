#!/bin/sh
# A "Unity build" for mlagents_envs that is really the fake player of envmanager.
# Use it as UnityEnvironment(file_name="examples/fake_unity_player.sh", ...): UnityEnvironment
# appends --mlagents-port <port> (and -logFile/-nographics/-batchmode/additional_args), e.g.
#
#   from mlagents_envs.environment import UnityEnvironment
#   env = UnityEnvironment("examples/fake_unity_player.sh", base_port=25000,
#                          additional_args=["--agents", "4", "--discrete", "3", "--episode-length", "20"])
#
# Any settings given here come before UnityEnvironment's arguments, so those win.
# FAKE_UNITY_PYTHON picks the interpreter (default: python3 on PATH, with mlagents-envs installed).
here=$(cd "$(dirname "$0")" && pwd)
exec "${FAKE_UNITY_PYTHON:-python3}" "$here/../envmanager/testing/fake_unity.py" "$@"
